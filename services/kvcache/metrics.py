"""The KV store's Prometheus metrics, read from the store at each scrape (`--metrics-port`)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class StoreCollector:
    def __init__(self, servicer):
        # services.kvcache.servicer.KVCacheServicer: its store, under its lock
        self.servicer = servicer

    def collect(self):
        with self.servicer.lock:
            store = self.servicer.store
            stats, disk = store.stats, store.disk
            tiers = {
                "dram": (store.dram.nbytes, len(store.dram), stats.dram, stats.dram.evictions),
                "disk": (
                    disk.nbytes if disk else 0,
                    len(disk) if disk else 0,
                    stats.disk,
                    disk.num_evictions if disk else 0,
                ),
            }
            values = {
                "bytes": GaugeMetricFamily(
                    "tandem:kv_store_bytes", "Bytes held, by tier.", labels=["tier"]
                ),
                "blocks": GaugeMetricFamily(
                    "tandem:kv_store_blocks", "Blocks held, by tier.", labels=["tier"]
                ),
                "hits": CounterMetricFamily(
                    "tandem:kv_store_hits", "Blocks read, by tier.", labels=["tier"]
                ),
                "misses": CounterMetricFamily(
                    "tandem:kv_store_misses",
                    "Blocks asked for and absent, by tier.",
                    labels=["tier"],
                ),
                "evictions": CounterMetricFamily(
                    "tandem:kv_store_evictions", "Blocks evicted, by tier.", labels=["tier"]
                ),
            }
            for tier, (nbytes, blocks, counts, evictions) in tiers.items():
                values["bytes"].add_metric([tier], nbytes)
                values["blocks"].add_metric([tier], blocks)
                values["hits"].add_metric([tier], counts.hits)
                values["misses"].add_metric([tier], counts.misses)
                values["evictions"].add_metric([tier], evictions)
            puts = CounterMetricFamily("tandem:kv_store_puts", "Blocks stored.")
            puts.add_metric([], stats.num_puts)
            full = GaugeMetricFamily(
                "tandem:kv_store_disk_full", "1 while the disk tier cannot write."
            )
            full.add_metric([], float(bool(disk and disk.disk_full)))
            corrupt = CounterMetricFamily(
                "tandem:kv_store_corrupt_files", "Disk files dropped as corrupt."
            )
            corrupt.add_metric([], disk.num_corrupt if disk else 0)
        yield from values.values()
        yield from (puts, full, corrupt)


def registry_for(servicer) -> CollectorRegistry:
    registry = CollectorRegistry()
    for collector in (ProcessCollector, PlatformCollector, GCCollector):
        collector(registry=registry)
    registry.register(StoreCollector(servicer))
    return registry
