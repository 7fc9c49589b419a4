"""The whole system on one machine: workers, a gateway and Envoy, each its own process.

Used by `make run` (deploy/launch.py), the tests and the benchmarks, so all three run the
same topology: `colocated` (N workers that each prefill and decode) or `disaggregated`
(prefill workers, decode workers, KV pushed between them). The gateway learns the workers
from a JSON file the stack writes (`workers_file`); rewrite it to change the set at run time.
Each process is a `Member` with its restart recipe (`members`, for deploy/supervisor.py): the
KV store, the draft service, the gateway and Envoy come back on the ports their peers were
given, the Mooncake master on its own; a worker on a new port, which `restarted` publishes.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from deploy.envoy.render import MAX_CONNECTIONS, render, start_envoy
from deploy.mooncake import Master, start_master, start_node
from deploy.probes import grpc_health, http_ready
from deploy.processes import Member, free_port, named_address, start_service, stop
from engine.cpu import format_cpu_list

TOPOLOGIES = ("colocated", "disaggregated")
ROLE_MODULES = {
    "both": "services.worker",
    "prefill": "services.prefill",
    "decode": "services.decode",
}
# A worker's role in the workers file -> its name in logs and metrics.
WORKER_NAMES = {"both": "worker", "prefill": "prefill", "decode": "decode"}


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
    members: list[Member] = field(default_factory=list)  # each process's restart recipe
    tmp: tempfile.TemporaryDirectory = field(default_factory=tempfile.TemporaryDirectory)

    @property
    def worker_addresses(self) -> list[str]:
        return [a for addresses in self.workers.values() for a in addresses]

    @property
    def workers_file(self) -> str:
        return os.path.join(self.tmp.name, "workers.json")

    @property
    def restarts_file(self) -> str:
        """Restarts by role, JSON, written by deploy/supervisor.py, read by the gateway."""
        return os.path.join(self.tmp.name, "restarts.json")

    def add(self, member: Member) -> None:
        self.members.append(member)
        self.processes.append(member.proc)

    def restarted(self, member: Member, old_proc: subprocess.Popen, old_address: str) -> None:
        """Puts a member's new process where its old one was; a worker's new address is
        published in the workers file (the gateway drops the old one, polls the new one)."""
        self.processes[self.processes.index(old_proc)] = member.proc
        if old_proc in self.mooncake_nodes:
            self.mooncake_nodes[self.mooncake_nodes.index(old_proc)] = member.proc
        role = next((r for r, name in WORKER_NAMES.items() if name == member.role), None)
        if role is not None:
            del self.worker_processes[old_address]
            self.worker_processes[member.address] = member.proc
            addresses = self.workers[role]
            addresses[addresses.index(old_address)] = member.address
            self.write_workers_file()

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
        """Starts a worker and lists it in `workers` (call `write_workers_file` to publish).
        Restarted, it binds a new port: only the workers file names it."""
        start = partial(
            start_service, ROLE_MODULES[role], "--model", model_dir, *args, stderr=stderr, env=env
        )
        proc, address = start()
        self.add(Member(WORKER_NAMES[role], address, proc, start, grpc_health))
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


def port_of(address: str) -> str:
    return address.rsplit(":", 1)[1]


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
            start = partial(
                start_service,
                "services.kvcache",
                "--host",
                host,
                *kv_store_args,
                stderr=stderr,
                env=kv_store_env,
            )
            store, stack.kv_store_address = start()
            again = partial(start, "--port", port_of(stack.kv_store_address))  # the workers' flag
            stack.add(Member("kvcache", stack.kv_store_address, store, again, grpc_health))
            worker_args = (*worker_args, "--kv-store", stack.kv_store_address)
            gateway_args = (*gateway_args, "--kv-store", stack.kv_store_address)
        if mooncake is not None:
            num_nodes, dram_bytes, replicas = mooncake
            progress(f"starting a Mooncake master and {num_nodes} store nodes ...")
            master_proc, master = start_master(
                host=host, stderr=stderr, offload=mooncake_disk_bytes > 0
            )
            stack.mooncake_master = master

            def restart_master() -> tuple[subprocess.Popen, str]:
                return start_master(master, stderr=stderr)[0], master.address  # the same ports

            stack.add(Member("mooncake-master", master.address, master_proc, restart_master))
            for i in range(num_nodes):
                start = partial(
                    start_node,
                    master,
                    dram_bytes,
                    stderr=stderr,
                    disk_bytes=mooncake_disk_bytes,
                    disk_dir=os.path.join(mooncake_disk_dir or stack.tmp.name, f"mooncake-node{i}"),
                )
                node, endpoint = start()
                stack.add(Member("mooncake-node", endpoint, node, start))
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
            start = partial(
                start_service,
                "services.draft",
                "--model",
                model_dir,
                "--host",
                host,
                *draft_args,
                stderr=stderr,
            )
            draft, stack.draft_address = start()
            again = partial(start, "--port", port_of(stack.draft_address))  # the workers' flag
            stack.add(Member("draft", stack.draft_address, draft, again, grpc_health))
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
        start = partial(
            start_service,
            "services.gateway",
            "--model",
            model_dir,
            "--workers-file",
            stack.workers_file,
            "--restarts-file",
            stack.restarts_file,
            "--host",
            host,
            *gateway_args,
            stderr=stderr,
            env=gateway_env,
        )
        gateway, stack.gateway_address = start()
        stack.openai_address = named_address(gateway, "openai")
        # Envoy's config names both ports
        again = partial(
            start,
            "--port",
            port_of(stack.gateway_address),
            "--http-port",
            port_of(stack.openai_address),
        )
        stack.add(Member("gateway", stack.gateway_address, gateway, again, grpc_health))
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
        stack.envoy_address = f"{host}:{port}"

        def restart_envoy() -> tuple[subprocess.Popen, str]:  # the same config, the same ports
            proc = start_envoy(config, stack.tmp.name, admin_port, stdout=stderr, stderr=stderr)
            return proc, stack.envoy_address

        envoy, _ = restart_envoy()
        ready = partial(http_ready, f"http://127.0.0.1:{admin_port}/ready")
        stack.add(Member("envoy", stack.envoy_address, envoy, restart_envoy, lambda _: ready()))
        return stack
    except BaseException:
        stack.stop()
        raise
