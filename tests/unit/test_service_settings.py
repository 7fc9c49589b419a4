"""The services' config base (services/settings.py): every service's host and port under the
same flags and TANDEM_<SERVICE>_* variables, checked once."""

import os

import pytest

from services.kvcache.config import StoreConfig


def test_a_service_reads_its_own_variables(monkeypatch):
    monkeypatch.setenv("TANDEM_KVCACHE_HOST", "0.0.0.0")
    monkeypatch.setenv("TANDEM_KVCACHE_PORT", "7001")
    config = StoreConfig.from_args([])
    assert (config.host, config.port) == ("0.0.0.0", 7001)
    assert StoreConfig.from_args(["--port", "7002"]).port == 7002  # a flag beats the variable


@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
def test_a_port_out_of_range_is_refused_by_name(flag):
    with pytest.raises(ValueError, match=f"{flag} must be in \\[0, 65535\\], not 70000"):
        StoreConfig.from_args([flag, "70000"])


def test_help_prints_a_literal_percent(capsys):
    with pytest.raises(SystemExit):
        StoreConfig.from_args(["--help"])
    assert "25% of free memory" in capsys.readouterr().out


def test_an_optional_field_takes_its_inner_type_from_a_flag_and_a_variable(monkeypatch):
    # dram_bytes is `int | None` (types.UnionType), as ruff's UP rules write Optional[int]
    assert StoreConfig.from_args(["--dram-bytes", "4096"]).dram_bytes == 4096
    monkeypatch.setenv("TANDEM_KV_STORE_DRAM_BYTES", "8192")
    assert StoreConfig.from_args([]).dram_bytes == 8192


def test_a_worker_leaves_cpus_to_its_front_end(monkeypatch):
    """The engine computes on the CPUs less --reserved-cpus (one: the worker's gRPC loop and,
    on one machine, the gateway, Envoy and clients), at least one; --cpu-threads overrides."""
    from services.worker import config as worker_config

    demo = os.path.join(os.path.dirname(__file__), "..", "..", "demo", "tandem-demo")

    def threads(cpus: int, *flags: str) -> int:
        monkeypatch.setattr(worker_config, "available_cpus", lambda: cpus)
        return worker_config.WorkerConfig.from_args(
            "both", ["--model", demo, *flags]
        ).engine.cpu_threads

    assert threads(16) == 15
    assert threads(2) == 1
    assert threads(1) == 1
    assert threads(16, "--reserved-cpus", "0") == 16
    assert threads(16, "--cpu-threads", "4") == 4
    monkeypatch.setenv("TANDEM_RESERVED_CPUS", "4")
    assert threads(16) == 12
    with pytest.raises(ValueError, match="--reserved-cpus must not be negative"):
        threads(16, "--reserved-cpus", "-1")


def test_a_worker_pinned_to_cpus_computes_on_a_thread_each(monkeypatch):
    from services.worker.config import WorkerConfig

    demo = os.path.join(os.path.dirname(__file__), "..", "..", "demo", "tandem-demo")
    mine = sorted(os.sched_getaffinity(0))
    config = WorkerConfig.from_args("both", ["--model", demo, "--cpus", str(mine[-1])])
    assert (config.cpus, config.engine.cpu_threads) == (str(mine[-1]), 1)
    assert (
        WorkerConfig.from_args(
            "both", ["--model", demo, "--cpus", str(mine[0]), "--cpu-threads", "3"]
        ).engine.cpu_threads
        == 3
    )
    with pytest.raises(ValueError, match=r"--cpus '4096': CPUs \[4096\] are not among"):
        WorkerConfig.from_args("both", ["--model", demo, "--cpus", "4096"])
    with pytest.raises(ValueError, match="not a CPU list"):
        WorkerConfig.from_args("both", ["--model", demo, "--cpus", "one"])
    with pytest.raises(ValueError, match=r"--borrowed-cpus '4096': CPUs \[4096\] are not among"):
        WorkerConfig.from_args("both", ["--model", demo, "--borrowed-cpus", "4096"])
    with pytest.raises(ValueError, match="not a CPU list"):
        WorkerConfig.from_args("both", ["--model", demo, "--borrowed-cpus", "zero"])


def test_the_stack_gives_each_worker_cpus_of_its_own_beside_the_first(monkeypatch):
    from deploy import stack

    monkeypatch.setattr(stack.os, "sched_getaffinity", lambda _: {0, 1, 2, 3, 4, 5, 6, 7})
    monkeypatch.delenv("TANDEM_CPU_THREADS", raising=False)
    monkeypatch.delenv("TANDEM_WORKER_CPUS", raising=False)
    assert stack.place_workers(1, ()) == [("--cpus", "1,2,3,4,5,6,7", "--borrowed-cpus", "0")]
    assert stack.place_workers(2, ()) == [("--cpus", "1,2,3"), ("--cpus", "4,5,6,7")]
    assert stack.place_workers(1, ("--borrowed-cpus", "")) == [("--cpus", "1,2,3,4,5,6,7")]
    assert stack.place_workers(8, ()) == []  # no CPU of its own for each: none pinned
    assert stack.place_workers(1, ("--cpu-threads", "2")) == []  # set by hand
    monkeypatch.setenv("TANDEM_CPU_THREADS", "2")
    assert stack.place_workers(1, ()) == []
    monkeypatch.setattr(stack.os, "sched_getaffinity", lambda _: {0, 1})
    monkeypatch.delenv("TANDEM_CPU_THREADS")
    assert stack.place_workers(1, ()) == [("--cpus", "1", "--borrowed-cpus", "0")]
    assert stack.place_workers(2, ()) == []
