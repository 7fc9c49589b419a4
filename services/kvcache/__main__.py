"""`python -m services.kvcache [--dram-bytes N] [--disk-bytes N] [--disk-dir DIR]`: the KV cache
store. Prints `kvcache ready on HOST:PORT kv=ADDRESS metrics=HOST:PORT` (writers push blocks to
ADDRESS; Prometheus per-tier bytes, blocks, hits, misses, evictions at /metrics), or
`kvcache failed to start: <cause>`. Serves grpc.health.v1; SIGTERM stops it (the disk tier
is kept for the next start)."""

from __future__ import annotations

import asyncio

from services import lifecycle
from services.kvcache.config import StoreConfig
from services.kvcache.disk import DiskTier
from services.kvcache.metrics import registry_for
from services.kvcache.servicer import KVCacheServicer
from services.kvcache.store import BlockStore
from services.kvtransfer import Senders, create_receiver
from tandem.v1 import kvcache_pb2_grpc


async def serve(config: StoreConfig) -> None:
    try:
        disk = DiskTier(config.disk_dir, config.disk_bytes) if config.disk_bytes else None
        store = BlockStore(config.dram_budget, disk)
        store.disk_admission_uses = config.disk_admission_uses
        servicer = KVCacheServicer(store, Senders(), config.transfer_timeout_s)
        servicer.events.event_loop = asyncio.get_running_loop()
        receiver = create_receiver(config.kv_transport, servicer.on_header, servicer.on_done)
        servicer.kv_address = receiver.start(config.host)
        service = lifecycle.GrpcService("kvcache", config.host, config.port)
        kvcache_pb2_grpc.add_KVCacheServicer_to_server(servicer, service.server)
        service.bind()
        metrics_address = lifecycle.start_metrics(
            config.host, config.metrics_port, registry_for(servicer)
        )
    except Exception as exc:
        lifecycle.fail_start("kvcache", exc)
    await service.start(kv=servicer.kv_address, metrics=metrics_address)
    await service.stopped()
    await service.stop(grace=2)
    receiver.close()
    servicer.senders.close()
    with servicer.lock:
        servicer.store.spill_all()


def main() -> None:
    lifecycle.run("kvcache", StoreConfig.from_args, serve)


if __name__ == "__main__":
    main()
