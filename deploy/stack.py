"""The whole system on one machine: workers, a gateway and Envoy, each its own process.

Used by `make run` (deploy/launch.py), the tests and the benchmarks, so all three run the
same topology: `colocated` (N workers that each prefill and decode) or `disaggregated`
(prefill workers, decode workers, KV pushed between them). The gateway learns the workers
from a JSON file the stack writes (`workers_file`); rewrite it to change the set at run time.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

from deploy.envoy.render import MAX_CONNECTIONS, render, start_envoy
from deploy.mooncake import Master, start_master, start_node
from deploy.processes import free_port, named_address, start_service, stop
from engine.cpu import format_cpu_list

TOPOLOGIES = ("colocated", "disaggregated")
ROLE_MODULES = {
    "both": "services.worker",
    "prefill": "services.prefill",
    "decode": "services.decode",
}


@dataclass
class LocalStack:
    workers: dict[str, list[str]] = field(
        default_factory=lambda: {role: [] for role in ROLE_MODULES}
    )
    gateway_address: str = ""  # gRPC, direct
    openai_address: str = ""  # the gateway's OpenAI HTTP, direct
    envoy_address: str = ""  # the public front door
    kv_store_address: str = ""  # the KV cache store's gRPC, when one runs
    draft_address: str = ""  # the draft service's gRPC, when one runs
    mooncake_master: Master | None = None  # KV_STORE=mooncake: the pool's master
    mooncake_nodes: list[subprocess.Popen] = field(default_factory=list)
    processes: list[subprocess.Popen] = field(default_factory=list)
    worker_processes: dict[str, subprocess.Popen] = field(default_factory=dict)  # by address
    tmp: tempfile.TemporaryDirectory = field(default_factory=tempfile.TemporaryDirectory)

    @property
    def worker_addresses(self) -> list[str]:
        return [a for addresses in self.workers.values() for a in addresses]

    @property
    def workers_file(self) -> str:
        return os.path.join(self.tmp.name, "workers.json")

    def write_workers_file(self) -> None:
        """Publishes `workers` to the gateway (atomically: it never reads half a file)."""
        partial = self.workers_file + ".partial"
        with open(partial, "w") as f:
            json.dump(self.workers, f)
        os.replace(partial, self.workers_file)

    def start_worker(
        self,
        role: str,
        model_dir: str,
        *args: str,
        stderr=subprocess.DEVNULL,
        env: dict | None = None,
    ) -> str:
        """Starts a worker and lists it in `workers` (call `write_workers_file` to publish)."""
        proc, address = start_service(
            ROLE_MODULES[role], "--model", model_dir, *args, stderr=stderr, env=env
        )
        self.processes.append(proc)
        self.worker_processes[address] = proc
        self.workers[role].append(address)
        return address

    def stop(self) -> None:
        for proc in reversed(self.processes):
            stop(proc)
        self.processes.clear()
        self.tmp.cleanup()


# Where the workers' threads are set by hand, the stack places nothing.
BY_HAND = ("--cpu-threads", "--cpus", "TANDEM_CPU_THREADS", "TANDEM_WORKER_CPUS")


def place_workers(num_workers: int, worker_args: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Each worker's CPU flags on this machine: --cpus, all but the first CPU split evenly, so
    that each engine keeps its CPUs and the gateway, Envoy and clients run beside them (measured
    on 2 vCPUs: the worker's gRPC loop is best beside its engine, with which it shares the GIL,
    and the others best unpinned); and a lone worker borrows the first CPU for its waves of
    prompts (--borrowed-cpus, unless given: engine/step_threads.py; several would contend for
    it). None ([]) where that leaves an engine no CPU of its own, or the workers' threads are
    set by hand (--cpu-threads, --cpus)."""
    first, *cpus = sorted(os.sched_getaffinity(0))
    given = {a.split("=")[0] for a in (*worker_args, *os.environ)}
    if len(cpus) < num_workers or given & set(BY_HAND):
        return []
    bounds = [i * len(cpus) // num_workers for i in range(num_workers + 1)]
    lends = num_workers == 1 and not given & {"--borrowed-cpus", "TANDEM_BORROWED_CPUS"}
    lent = ("--borrowed-cpus", str(first)) if lends else ()
    return [("--cpus", format_cpu_list(cpus[a:b]), *lent) for a, b in zip(bounds, bounds[1:])]


def start_stack(
    model_dir: str,
    port: int = 0,
    num_workers: int = 1,
    host: str = "127.0.0.1",
    worker_args: tuple[str, ...] = (),
    gateway_args: tuple[str, ...] = (),
    stderr=subprocess.DEVNULL,
    progress: Callable[[str], None] = lambda _: None,
    topology: str = "colocated",
    num_prefill: int = 1,
    num_decode: int = 1,
    role_args: dict[str, tuple[str, ...]] | None = None,
    worker_env: dict[str, dict] | None = None,
    gateway_env: dict | None = None,
    public_metrics: bool = True,
    kv_store_args: tuple[str, ...] | None = None,
    kv_store_env: dict | None = None,
    mooncake: tuple[int, int, int] | None = None,
    mooncake_disk_bytes: int = 0,
    mooncake_disk_dir: str = "",
    draft_args: tuple[str, ...] | None = None,
    tls: tuple[str, str] | None = None,
    envoy_max_connections: int = MAX_CONNECTIONS,
) -> LocalStack:
    """Starts everything, each process once it is ready, and stops what started on failure.
    `role_args` and `worker_env` add flags and environment variables per role (`both`,
    `prefill`, `decode`) to `worker_args`; `gateway_env` adds the gateway's. `kv_store_args`
    (not None) starts a KV cache store first, with those flags (and `kv_store_env`), and points
    every worker at it; `mooncake` (store nodes, each node's DRAM bytes, replicas of a block)
    starts a Mooncake Store pool instead (deploy/mooncake.py) and points every worker at it
    and the gateway (routing credit from existence queries), each node with a disk tier of
    `mooncake_disk_bytes` (0: none) in its own folder of `mooncake_disk_dir` (default: the
    stack's run directory); `draft_args` (not None: at least
    `--draft-model DIR`) likewise starts a draft service for the model and makes every worker
    draft from it. `tls` (certificate chain, private key: PEM files) makes Envoy's public
    listener speak TLS; `envoy_max_connections` caps its downstream connections."""
    if topology not in TOPOLOGIES:
        raise ValueError(f"TOPOLOGY must be one of {TOPOLOGIES}, not {topology!r}")
    counts = (
        {"both": num_workers}
        if topology == "colocated"
        else {"prefill": num_prefill, "decode": num_decode}
    )
    stack = LocalStack()
    try:
        if kv_store_args is not None:
            progress("starting the KV cache store ...")
            store, stack.kv_store_address = start_service(
                "services.kvcache", "--host", host, *kv_store_args, stderr=stderr, env=kv_store_env
            )
            stack.processes.append(store)
            worker_args = (*worker_args, "--kv-store", stack.kv_store_address)
            gateway_args = (*gateway_args, "--kv-store", stack.kv_store_address)
        if mooncake is not None:
            num_nodes, dram_bytes, replicas = mooncake
            progress(f"starting a Mooncake master and {num_nodes} store nodes ...")
            master_proc, stack.mooncake_master = start_master(
                host=host, stderr=stderr, offload=mooncake_disk_bytes > 0
            )
            stack.processes.append(master_proc)
            for i in range(num_nodes):
                node, _ = start_node(
                    stack.mooncake_master,
                    dram_bytes,
                    stderr=stderr,
                    disk_bytes=mooncake_disk_bytes,
                    disk_dir=os.path.join(mooncake_disk_dir or stack.tmp.name, f"mooncake-node{i}"),
                )
                stack.processes.append(node)
                stack.mooncake_nodes.append(node)
            worker_args = (
                *worker_args,
                "--kv-store",
                stack.mooncake_master.kv_store,
                "--kv-store-replicas",
                str(replicas),
            )
            gateway_args = (*gateway_args, "--kv-store", stack.mooncake_master.kv_store)
        if draft_args is not None:
            progress("starting the draft service ...")
            draft, stack.draft_address = start_service(
                "services.draft", "--model", model_dir, "--host", host, *draft_args, stderr=stderr
            )
            stack.processes.append(draft)
            worker_args = (*worker_args, "--draft", stack.draft_address)
        placed = place_workers(
            sum(counts.values()),
            (
                *worker_args,
                *(a for args in (role_args or {}).values() for a in args),
                *(k for env in (worker_env or {}).values() for k in env),
            ),
        )
        for role, count in counts.items():
            name = {"both": "worker"}.get(role, f"{role} worker")
            for i in range(count):
                progress(f"starting {name} {i + 1}/{count} ...")
                args = ("--host", host, *worker_args, *(role_args or {}).get(role, ()))
                if placed:
                    args += placed.pop(0)
                stack.start_worker(
                    role, model_dir, *args, stderr=stderr, env=(worker_env or {}).get(role)
                )
        stack.write_workers_file()
        progress("starting gateway ...")
        gateway, stack.gateway_address = start_service(
            "services.gateway",
            "--model",
            model_dir,
            "--workers-file",
            stack.workers_file,
            "--host",
            host,
            *gateway_args,
            stderr=stderr,
            env=gateway_env,
        )
        stack.processes.append(gateway)
        stack.openai_address = named_address(gateway, "openai")
        port = port or free_port()
        progress(f"starting envoy on {host}:{port} ...")
        admin_port = free_port()
        config = render(
            port,
            admin_port,
            stack.gateway_address,
            stack.openai_address,
            host=host,
            public_metrics=public_metrics,
            tls=tls,
            max_connections=envoy_max_connections,
        )
        with tempfile.TemporaryDirectory() as tmp:  # Envoy reads its static config once, at start
            stack.processes.append(
                start_envoy(config, tmp, admin_port, stdout=stderr, stderr=stderr)
            )
        stack.envoy_address = f"{host}:{port}"
        return stack
    except BaseException:
        stack.stop()
        raise
