"""The whole system on one machine: workers, a gateway and Envoy, each its own process.

Used by `make run` (deploy/launch.py), the tests and the benchmarks, so all three run the
same topology.
"""

from __future__ import annotations

import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Callable

from deploy.envoy.render import render, start_envoy
from deploy.processes import free_port, named_address, start_service, stop


@dataclass
class LocalStack:
    worker_addresses: list[str] = field(default_factory=list)
    gateway_address: str = ""  # gRPC, direct
    openai_address: str = ""  # the gateway's OpenAI HTTP, direct
    envoy_address: str = ""  # the public front door
    processes: list[subprocess.Popen] = field(default_factory=list)

    def stop(self) -> None:
        for proc in reversed(self.processes):
            stop(proc)
        self.processes.clear()


def start_stack(model_dir: str, port: int = 0, num_workers: int = 1, host: str = "127.0.0.1",
                worker_args: tuple[str, ...] = (), gateway_args: tuple[str, ...] = (),
                stderr=subprocess.DEVNULL, progress: Callable[[str], None] = lambda _: None) -> LocalStack:
    """Starts everything, each process once it is ready, and stops what started on failure."""
    stack = LocalStack()
    try:
        for i in range(num_workers):
            progress(f"starting worker {i + 1}/{num_workers} ...")
            proc, address = start_service("services.worker", "--model", model_dir, *worker_args, stderr=stderr)
            stack.processes.append(proc)
            stack.worker_addresses.append(address)
        progress("starting gateway ...")
        gateway, stack.gateway_address = start_service(
            "services.gateway", "--model", model_dir, "--workers", ",".join(stack.worker_addresses),
            *gateway_args, stderr=stderr)
        stack.processes.append(gateway)
        stack.openai_address = named_address(gateway, "openai")
        port = port or free_port()
        progress(f"starting envoy on {host}:{port} ...")
        admin_port = free_port()
        config = render(port, admin_port, stack.gateway_address, stack.openai_address, host=host)
        with tempfile.TemporaryDirectory() as tmp:  # Envoy reads its static config once, at start
            stack.processes.append(start_envoy(config, tmp, admin_port, stdout=stderr, stderr=stderr))
        stack.envoy_address = f"{host}:{port}"
        return stack
    except BaseException:
        stack.stop()
        raise
