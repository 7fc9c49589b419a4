"""What the store holds, per namespace, as numbered events for the gateways' indexes.

The store reports every key whose holding may have changed (a put committed, a DRAM
eviction, a promotion, a disk write done, a file dropped), from whichever thread changed it.
Changes are coalesced and published on the event loop, each as the key's tier at that moment
(`dram`, `disk`, or `""`: gone), in its namespace's log (services/event_log.py). An event
states the holding now, not the transition, so a subscriber that applies them in order
converges on the store's contents however the threads interleaved. Namespaces nobody follows
keep no log: a first subscriber starts from a snapshot.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from services.event_log import EventBatch, EventLog
from services.kvcache.keys import Key


class StoreEvents:
    def __init__(self, tier_of: Callable[[Key], str], held: Callable[[str], list[tuple[int, str]]]):
        self.tier_of = tier_of  # "dram" | "disk" | "" (gone)
        self.held = held  # every (block hash, tier) of a namespace
        self.event_loop: asyncio.AbstractEventLoop | None = None
        self._logs: dict[str, EventLog] = {}
        self._changed: dict[Key, None] = {}  # ordered, each key once
        self._lock = threading.Lock()
        self._scheduled = False

    def changed(self, key: Key) -> None:
        """Any thread."""
        with self._lock:
            if key[0] not in self._logs or self.event_loop is None:
                return
            self._changed[key] = None
            if self._scheduled:
                return
            self._scheduled = True
        self.event_loop.call_soon_threadsafe(self._publish)

    def _publish(self) -> None:
        with self._lock:
            changed, self._changed, self._scheduled = list(self._changed), {}, False
        by_namespace: dict[str, list[tuple[int, str]]] = {}
        for key in changed:
            by_namespace.setdefault(key[0], []).append((key[1], self.tier_of(key)))
        for namespace, events in by_namespace.items():
            self._logs[namespace].record(events)

    def subscribe(self, namespace: str) -> tuple[asyncio.Queue, EventBatch, str]:
        """On the event loop: a queue of later batches, the snapshot, the log's incarnation."""
        with self._lock:
            log = self._logs.get(namespace)
            if log is None:
                log = self._logs[namespace] = EventLog(self.event_loop)
        queue = log.subscribe()
        return queue, log.snapshot(self.held(namespace)), log.incarnation

    def unsubscribe(self, namespace: str, queue: asyncio.Queue) -> None:
        self._logs[namespace].unsubscribe(queue)
