"""bench/soak.py, shortened: `make run` (the demo model, the KV store on) under mixed traffic
while a worker is killed, then paused, a client drops its streams and a burst arrives. Nothing
hangs, every failure is a retriable status, each fault is recovered from within 10 s, and the
restarts are counted."""

from __future__ import annotations

from bench.soak import recovered, soak
from tests.e2e.make_run import demo_with_store

RETRIABLE = {"503", "529", "ConnectError", "RemoteProtocolError"}


def test_a_short_soak_with_faults_loses_nothing_and_recovers(tmp_path):
    env, _ = demo_with_store(tmp_path / "kvcache")
    faults = ["kill worker", "pause worker", "disconnect", "burst"]
    report = soak(1.0, env, "tandem-demo", clients=3, burst=40, faults=faults, say=lambda _: None)
    assert report["hung"] == 0
    assert report["completed"] > 100
    assert set(report["failed"]) <= RETRIABLE, report["failed"]
    assert recovered(report), report["faults"]
    assert report["restarts"].get("worker") == 2
    assert len(report["restart_lines"]) == 2
