"""Start tandem's services as processes and read the address each binds (launcher and tests)."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

STARTUP_TIMEOUT_S = 120
# numpy asks for transparent huge pages on arrays of 4 MiB and more (KV payloads, transfer
# buffers); where the kernel compacts memory for them on a fault (defrag "madvise"), each
# first write of a page stalled ~45 us. Services get plain pages unless the caller says.
# Defaults for every service (this process's environment overrides them). GOMP_SPINCOUNT: an
# OpenMP thread that finished its work spins 10,000 times before it sleeps, not libgomp's
# 300,000 (~5 ms on Zen 5), so a worker's thread on a CPU it borrows (engine/step_threads.py)
# gives it back to the front end at once: 256-token prompts one at a time, served, TTFT median
# 18.8-20.0 -> 15.9-18.9 ms (bench/README.md).
SERVICE_ENV = {"NUMPY_MADVISE_HUGEPAGE": "0", "GOMP_SPINCOUNT": "10000"}
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# A stack process's role (Member.role: its name in logs and metrics) -> how one part of its
# command line ends: its module, binary or config (tools that find a stack's processes).
ROLE_COMMANDS = {
    "worker": "services.worker",
    "prefill": "services.prefill",
    "decode": "services.decode",
    "gateway": "services.gateway",
    "kvcache": "services.kvcache",
    "mooncake-master": "/mooncake_master",
    "mooncake-node": "services.kvcache.mooncake_node",
    "draft": "services.draft",
    "envoy": "envoy.yaml",
}


def role_of(cmdline: list[str]) -> str | None:
    """The stack role of a process with this command line, if any."""
    return next(
        (r for r, end in ROLE_COMMANDS.items() if any(p.endswith(end) for p in cmdline)), None
    )


class ServiceFailed(RuntimeError):
    """A service exited before it was ready; the message is its own one-line cause."""


@dataclass
class Member:
    """A process of a stack and how to start it again where its peers expect it
    (deploy/supervisor.py restarts it). `start` starts a new one and returns it with its
    address; it raises ServiceFailed (or RuntimeError) when the new one does not get ready.
    `probe(address)`: whether it answers now (its health); None: only its exit is watched."""

    role: str  # worker, prefill, decode, kvcache, draft, mooncake-master, mooncake-node, gateway, envoy
    address: str
    proc: subprocess.Popen
    start: Callable[[], tuple[subprocess.Popen, str]]
    probe: Callable[[str], bool] | None = None


def start_service(
    module: str, *args: str, stderr=subprocess.DEVNULL, env: dict | None = None
) -> tuple[subprocess.Popen, str]:
    """Runs `python -m module args...`; returns the process and the host:port of its ready
    line (`... ready on HOST:PORT [name=HOST:PORT ...]`; see `named_address` for the rest).
    `env` adds to this process's environment. Raises ServiceFailed with the service's
    `... failed to start: <cause>` line when it prints one."""
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        cwd=REPO_ROOT,
        env={**SERVICE_ENV, **os.environ, **(env or {})},
    )
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if " ready on " in line:
            proc.ready_line = line
            _forward_output(proc.stdout, stderr)
            return proc, line.split(" ready on ")[1].split()[0]
        if " failed to start: " in line:
            proc.wait(timeout=10)
            raise ServiceFailed(line.strip())
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise ServiceFailed(f"{module} did not start (exit code {proc.poll()}); its log above says why")


def _forward_output(stdout, log) -> None:
    """Copies what a ready service writes to stdout (UCX logs its warnings there) to its log,
    where its stderr goes, until it exits. A pipe nobody reads fills at 64 KiB, and then the
    service's next write, such as UCX's progress thread logging, blocks forever."""

    def forward() -> None:
        sink = sys.stderr if log is None else log if hasattr(log, "write") else None
        for line in stdout:
            try:
                if sink is not None:
                    sink.write(line)
                    sink.flush()
            except (OSError, ValueError):  # the log was closed: keep draining
                sink = None

    threading.Thread(target=forward, name="service-stdout", daemon=True).start()


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


def named_address(proc: subprocess.Popen, name: str) -> str:
    """The `name=HOST:PORT` address from a service's ready line."""
    return next(w.split("=", 1)[1] for w in proc.ready_line.split() if w.startswith(name + "="))


def free_port() -> int:
    """A port free right now on loopback, for services that cannot bind port 0 themselves.
    Taken below the kernel's ephemeral range: a port from within it (bind to 0) can go to any
    outgoing connection in the moment before the service binds it (CI saw EADDRINUSE)."""
    first_ephemeral = _ephemeral_range()[0]
    rng = random.Random()  # never the global generator: tests and the engine seed it
    for _ in range(64):
        port = rng.randrange(10_000, first_ephemeral) if first_ephemeral > 11_000 else 0
        if port in _given:  # handed out already, maybe not yet bound (`port, admin = ...`)
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = sock.getsockname()[1]
        _given.add(port)
        return port
    raise OSError("no free port on loopback")


_given: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = f.read().split()
        return int(low), int(high)
    except (OSError, ValueError):  # not Linux: the IANA range
        return 49152, 65535
