"""Liveness probes the supervisor runs on the stack's processes (deploy/supervisor.py).

Each answers whether a process serves now, within PROBE_TIMEOUT_S: a gRPC service's
grpc.health.v1 Check (any status counts: a draining service is alive), Envoy's admin /ready.
A paused process (SIGSTOP) still accepts connections (the kernel completes the handshake) but
never answers, so it fails these; `is_paused` sees it at once from its process state.
"""

from __future__ import annotations

import urllib.request

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

PROBE_TIMEOUT_S = 2.0


def grpc_health(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout_s, wait_for_ready=True
            )
        except grpc.RpcError:
            return False
    return True


def http_ready(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s):
            return True
    except OSError:  # refused, timed out, or an HTTP error status
        return False


def is_paused(pid: int) -> bool:
    """Stopped by a signal (SIGSTOP, SIGTSTP), not by a debugger."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.Error:  # gone: its exit is seen elsewhere
        return False
