"""KV transfers arriving at a decode worker, from accept to hand-over to the engine.

- accept (`on_header`): check the blocks fit this pool, reserve that many blocks through the
  engine's KV connector, and hand the transport its `landing` buffers: views of the pool (one per
  layer and run of adjacent block ids), so the bytes land straight in it: no staging copy, no work
  for the engine thread. A parallel engine's pool here holds rank 0's share only: its transfers land
  in a staging tensor, which the engine settles into every rank's pool when the request is added.
  The leading blocks this worker already holds in its own prefix cache (by the header's block
  hashes) are shared instead, and the sender leaves them out: a conversation's next turn moves only
  its new blocks. A full pool is waited on (running sequences free blocks as they finish), as a
  colocated worker's scheduler waits: refused only when the transfer's deadline passes first, or
  when the prompt could never fit;
- land (`on_done(ok=True)`): keep the blocks for `landed_ttl_s` (no running sequence reads
  reserved blocks, so the transport's threads may write them while the engine steps);
- fail (`on_done(ok=False)`): free the blocks at once;
- hand over (`take`, on the event loop): the Decode call claims the landed blocks, waiting at
  most its timeout (woken by the landing, no thread held while it waits);
- expire (`reap`, every second): landed blocks nobody claimed in time are freed, so a
  gateway that died between Prefill and Decode leaks nothing.

While the worker drains, new transfers are refused (the prefill side reports UNAVAILABLE and
the gateway picks another decode worker); those already accepted still land and decode.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass

import numpy as np

from engine.requests import Reservation
from services.kvtransfer import Accepted, TransferHeader, TransferRefused
from services.worker.engine_loop import EngineLoop

log = logging.getLogger(__name__)
ROOM_POLL_S = 0.02


@dataclass
class Transfer:
    header: TransferHeader
    reservation: Reservation  # its leading `num_cached` blocks are shared from this worker's prefix cache (not sent)
    landed_at: float = 0.0  # 0 while the bytes are still arriving

    @property
    def blocks(self) -> list[int]:
        return self.reservation.blocks

    @property
    def num_cached(self) -> int:
        return self.reservation.num_cached

    @property
    def num_bytes_received(self) -> int:
        return self.header.nbytes * (len(self.blocks) - self.num_cached) // max(len(self.blocks), 1)


class KVInbox:
    def __init__(self, loop: EngineLoop, landed_ttl_s: float):
        self.loop = loop
        self.landed_ttl_s = landed_ttl_s
        self.kv = loop.engine.kv
        self.block_shape = list(self.kv.layout.block_shape)  # [layers, 2, bs, kv_heads, head_dim]
        self.dtype = self.kv.layout.dtype
        self._transfers: dict[str, Transfer] = {}
        self._waiters: dict[str, asyncio.Future] = {}  # Decode calls waiting for their KV to land
        self.draining = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        threading.Thread(target=self._reap_forever, name="kv-inbox-reaper", daemon=True).start()

    @property
    def num_transfers(self) -> int:
        """Transfers accepted and not yet claimed or dropped."""
        return len(self._transfers)

    def on_header(self, header: TransferHeader) -> Accepted:
        if self.draining:
            raise TransferRefused("the decode worker is draining (shutting down)")
        shape = header.shape
        if (
            len(shape) != 6
            or [shape[0], *shape[2:]] != self.block_shape
            or header.dtype != str(self.dtype)[6:]
        ):
            raise TransferRefused(
                f"KV of shape {shape} ({header.dtype}) does not fit this pool's blocks "
                f"{self.block_shape} ({self.dtype}); is it the same model?"
            )
        expected = shape[1] * int(np.prod(self.block_shape)) * self.dtype.itemsize
        if header.nbytes != expected:
            raise TransferRefused(
                f"KV payload of {header.nbytes} bytes; {shape[1]} blocks are {expected} bytes"
            )
        with self._lock:
            if header.request_id in self._transfers:
                raise TransferRefused(f"a transfer for {header.request_id!r} is already here")
        if shape[1] > self.kv.layout.num_blocks:
            raise TransferRefused(
                f"no room for the KV: {shape[1]} blocks, the pool has {self.kv.layout.num_blocks}"
            )
        deadline = time.monotonic() + header.deadline_s
        while True:
            try:
                reservation = self.loop.call(self.kv.reserve, shape[1], header.block_hashes)
                break
            except MemoryError as exc:
                if time.monotonic() + ROOM_POLL_S > deadline:
                    raise TransferRefused(
                        f"no room for the KV within {header.deadline_s:.1f}s: {exc}"
                    ) from None
                time.sleep(ROOM_POLL_S)
        transfer = Transfer(header, reservation)
        segments = self.kv.landing(reservation)
        with self._lock:
            self._transfers[header.request_id] = transfer
        return Accepted(segments, reservation.num_cached)

    def on_done(self, header: TransferHeader, ok: bool) -> None:
        with self._lock:
            transfer = self._transfers.get(header.request_id)
        if transfer is None:
            return
        if ok:
            with self._lock:
                transfer.landed_at = time.monotonic()
                waiter = self._waiters.pop(header.request_id, None)
            if waiter is not None:
                waiter.get_loop().call_soon_threadsafe(_wake, waiter)
        else:
            self._drop(header.request_id)

    async def take(self, request_id: str, timeout_s: float) -> Transfer:
        """The landed transfer for a request, now owned by the caller (who imports or frees its
        blocks). Raises TimeoutError when it has not landed within `timeout_s`."""
        landed = asyncio.get_running_loop().create_future()
        with self._lock:
            transfer = self._transfers.get(request_id)
            if transfer is not None and transfer.landed_at:
                return self._transfers.pop(request_id)
            self._waiters[request_id] = landed
        try:
            await asyncio.wait_for(landed, timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"the KV of {request_id!r} did not land within {timeout_s:.1f}s"
            ) from None
        finally:
            with self._lock:
                if self._waiters.get(request_id) is landed:
                    del self._waiters[request_id]
        with self._lock:
            transfer = self._transfers.pop(request_id, None)
        if transfer is None:  # landed, then expired before this call woke
            raise TimeoutError(f"the KV of {request_id!r} is gone")
        return transfer

    def _drop(self, request_id: str) -> None:
        with self._lock:
            transfer = self._transfers.pop(request_id, None)
        if transfer is not None:
            self.loop.post(self.kv.free, transfer.reservation)

    def reap(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [
                rid
                for rid, t in self._transfers.items()
                if t.landed_at and now - t.landed_at > self.landed_ttl_s
            ]
        for request_id in expired:
            log.warning(
                "KV of %s landed but no Decode call claimed it in %.0fs; freeing it",
                request_id,
                self.landed_ttl_s,
            )
            self._drop(request_id)

    def _reap_forever(self) -> None:
        while not self._stop.wait(1.0):
            self.reap()

    def close(self) -> None:
        self._stop.set()


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)
