"""A worker's KV cache events, numbered, for the gateways' prefix indexes.

The engine records every block it registers under a hash (stored) and every cached block it
evicts. After each step the engine loop drains them into this log (so the engine's list
never grows); the log (services/event_log.py) numbers them and hands each batch to the
subscribers on the event loop. A subscriber's snapshot, every hash cached now, is taken on
the engine thread together with the number of the next event.
"""

from __future__ import annotations

from engine.block_manager import KVEvent
from services.event_log import EventBatch, EventLog


class KVEventLog(EventLog):
    def snapshot_of(self, block_hashes: list[int]) -> EventBatch:
        """Every hash cached now (`KVConnector.cached_block_hashes`), as one stored event."""
        return self.snapshot([KVEvent("stored", tuple(block_hashes))])
