"""What the KV cache store holds of a prompt, for the routing cost (`--kv-store HOST:PORT`).

One `Lookup` per routed request, under a short deadline (`TIMEOUT_S`): the store answers
with the tier of each block of the prompt's longest stored prefix. Any failure means "nothing
stored" (routing goes on as without a store), and `MAX_FAILURES` failures in a row skip the
store for `BACKOFF_S`.
"""

from __future__ import annotations

import logging
import time

import grpc

from tandem.v1 import kvcache_pb2, kvcache_pb2_grpc

log = logging.getLogger(__name__)
TIMEOUT_S = 0.05
MAX_FAILURES = 3
BACKOFF_S = 10.0


class StoreView:
    def __init__(self, address: str):
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = kvcache_pb2_grpc.KVCacheStub(self.channel)
        self.num_failures = 0
        self.skip_until = 0.0

    async def stored_tiers(self, namespace: str, block_hashes: list[int]) -> list[str]:
        """`dram` or `disk` for each block of the longest stored prefix; [] when unknown."""
        if not namespace or not block_hashes or time.monotonic() < self.skip_until:
            return []
        try:
            reply = await self.stub.Lookup(kvcache_pb2.LookupRequest(namespace=namespace, block_hashes=block_hashes),
                                           timeout=TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            self.num_failures += 1
            if self.num_failures >= MAX_FAILURES:
                log.warning("KV store lookups failed %d times (%s); routing without it for %.0fs",
                            self.num_failures, exc.code().name, BACKOFF_S)
                self.skip_until, self.num_failures = time.monotonic() + BACKOFF_S, 0
            return []
        self.num_failures = 0
        return list(reply.tiers)

    async def close(self) -> None:
        await self.channel.close()
