"""`tandem:process_restarts_total{role}` on the gateway's /metrics: the restarts `make run`'s
supervisor counted (deploy/supervisor.py), read from its JSON file at every scrape, so the
count outlives a restart of the gateway itself."""

from __future__ import annotations

import json
import logging

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from services.gateway.metrics import REGISTRY

log = logging.getLogger(__name__)


class RestartCounts(Collector):
    def __init__(self, path: str):
        self.path = path

    def collect(self):
        family = CounterMetricFamily(
            "tandem:process_restarts",
            "Processes of the stack restarted by make run's supervisor, by role.",
            labels=["role"],
        )
        try:
            with open(self.path) as f:
                counts = json.load(f)
        except (OSError, ValueError) as exc:  # not written yet, or no supervisor
            log.debug("no restart counts in %s: %s", self.path, exc)
            counts = {}
        for role, count in sorted(counts.items()):
            family.add_metric([role], count)
        yield family


_COUNTS = RestartCounts("")


def export(path: str) -> None:
    """Shows the counts in `path` on /metrics (registered once a process: tests start
    gateways in one)."""
    if not _COUNTS.path:
        REGISTRY.register(_COUNTS)
    _COUNTS.path = path
