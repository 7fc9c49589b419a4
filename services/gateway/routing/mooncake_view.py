"""What a Mooncake Store pool holds, for the routing cost (`--kv-store mooncake://...`): the
same `stored_tiers` as store_view.StoreView, from batched existence queries.

Mooncake 0.3.13 publishes no per-namespace event stream a gateway could follow (its master's
KV events go over ZMQ, off by default), so this first version asks: routing reads a local map
of the blocks confirmed present and never waits on Mooncake; a prompt's blocks not confirmed
within `refresh_s` are queried (`batch_is_exist`, one call for the whole prompt) on a thread
of the view's own, and the answer serves the prompts after it. So the first request with a
new prefix gets no store credit, and the next ones do.

Bound: a block is credited at most `credit_s` after Mooncake last said it holds it. Mooncake
itself answers "held" for a block of a dead node until its master drops the node
(`--client_ttl`, 10 s), so credit for a lost block ends within client_ttl + `credit_s`. Wrong
credit costs a routing preference only: the worker finds the miss and computes. A query that
fails (master gone) drops every credit at once. All blocks count as the store's DRAM tier.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from services.kvcache.mooncake_pool import block_key, connect

log = logging.getLogger(__name__)
MAX_ENTRIES = 100_000  # past it, entries older than the horizons are dropped


class MooncakeView:
    def __init__(
        self,
        address: str,
        host: str = "127.0.0.1",
        refresh_s: float = 1.0,
        credit_s: float = 5.0,
        timeout_s: float = 2.0,
    ):
        self.address, self.host = address, host
        self.refresh_s, self.credit_s, self.timeout_s = refresh_s, credit_s, timeout_s
        self.confirmed: dict[int, float] = {}  # block hash -> when Mooncake last held it
        self.asked: dict[int, float] = {}  # block hash -> when it was last queried
        # Joined at start, while the master runs: a client joining a dead master retries for
        # over a minute, and the event loop with it (as measured).
        try:
            self.store = connect(address, host, 0, timeout_s)
        except OSError as exc:
            log.warning("no routing credit for the Mooncake pool at %s: %s", address, exc)
            self.store = None
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="mooncake-view")
        self._tasks: set[asyncio.Task] = set()

    def stored_tiers(self, namespace: str, block_hashes: list[int]) -> list[str]:
        """`dram` for each block of the longest prefix confirmed held; queries what is stale."""
        now = time.monotonic()
        tiers = []
        for block_hash in block_hashes:
            if now - self.confirmed.get(block_hash, -self.credit_s) >= self.credit_s:
                break
            tiers.append("dram")
        stale = [
            h for h in block_hashes if now - self.asked.get(h, -self.refresh_s) >= self.refresh_s
        ]
        if namespace and stale:
            self.asked.update(dict.fromkeys(stale, now))
            task = asyncio.create_task(self._query(namespace, stale))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return tiers

    def _exists(self, namespace: str, block_hashes: list[int]) -> list[int]:
        if self.store is None:
            return [0] * len(block_hashes)
        return self.store.batch_is_exist([block_key(namespace, h) for h in block_hashes])

    async def _query(self, namespace: str, block_hashes: list[int]) -> None:
        try:
            exists = await asyncio.wait_for(
                asyncio.get_running_loop().run_in_executor(
                    self.thread, self._exists, namespace, block_hashes
                ),
                self.timeout_s,
            )
        except Exception as exc:
            log.warning("Mooncake pool at %s: existence query failed (%r)", self.address, exc)
            self.confirmed = {}
            return
        now = time.monotonic()
        for block_hash, held in zip(block_hashes, exists, strict=True):
            if held == 1:
                self.confirmed[block_hash] = now
            else:
                self.confirmed.pop(block_hash, None)
        self._trim(now)

    def _trim(self, now: float) -> None:
        """Forgets what is too old to matter, so the maps stay the size of recent traffic."""
        if len(self.asked) > MAX_ENTRIES:
            horizon = max(self.credit_s, self.refresh_s)
            self.asked = {h: t for h, t in self.asked.items() if now - t < horizon}
            self.confirmed = {h: t for h, t in self.confirmed.items() if now - t < self.credit_s}

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        self.thread.shutdown(wait=False, cancel_futures=True)
        if self.store is not None:
            self.store.close()
