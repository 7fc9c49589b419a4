"""Following a numbered event stream (services/event_log.py): a worker's KV events
(kv_events.py) or the KV store's (store_view.py).

`Numbering` checks that a stream's batches follow on: first a snapshot (possibly in parts),
then batches from the same incarnation without a gap in their numbers; anything else raises
ResyncNeeded. `follow` runs a stream for ever: whenever it breaks (a gap, a new incarnation,
an error, its end), what was learnt from it is dropped, so no routing decision rests on
blocks that may be gone, and it subscribes again (a fresh snapshot) every `retry_s`. A break
of a stream that had delivered its snapshot is logged as a warning; failed resubscriptions
quietly.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc

log = logging.getLogger(__name__)


class ResyncNeeded(Exception):
    pass


class Numbering:
    def __init__(self):
        self.expected = None  # the number the next batch must start at
        self.incarnation = None
        self.in_snapshot = False

    def check(
        self, incarnation: str, first_seq: int, snapshot: bool, num_events: int, more: bool = False
    ) -> bool:
        """True when the batch starts a snapshot: what was held before goes."""
        if snapshot:
            starts = not self.in_snapshot
            if starts:
                self.incarnation, self.expected = incarnation, first_seq
            self.in_snapshot = more
            return starts
        if self.in_snapshot or first_seq != self.expected or incarnation != self.incarnation:
            raise ResyncNeeded(f"event {first_seq} where {self.expected} was due")
        self.expected += num_events
        return False


async def follow(
    what: str,
    stream: Callable[[Numbering], Awaitable[None]],
    drop: Callable[[], None],
    retry_s: float,
) -> None:
    """Runs `stream` (one subscription, checked by the Numbering it is given; it returns or
    raises when the stream breaks) again and again; `drop` forgets what it taught."""
    while True:
        numbering = Numbering()
        try:
            await stream(numbering)
            raise ResyncNeeded("the stream ended")
        except (grpc.aio.AioRpcError, ResyncNeeded) as exc:
            why = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            was_working = numbering.expected is not None
            (log.warning if was_working else log.debug)(
                "%s: %s; resubscribing every %.1fs", what, why, retry_s
            )
        except asyncio.CancelledError:
            raise
        except Exception:  # never let a feed die: drop and try again
            log.exception("%s failed", what)
        drop()
        await asyncio.sleep(retry_s)
