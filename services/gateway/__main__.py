"""`python -m services.gateway --model DIR --workers HOST:PORT[,...]`: the public API.

Disaggregated: `--prefill HOST:PORT[,...] --decode HOST:PORT[,...]`; any set may also come
from `--workers-file` and `dns:NAME:PORT` entries (see services/gateway/routing/endpoints.py).

One asyncio event loop serves gRPC (tandem.v1.Inference and grpc.health.v1, on grpc.aio)
and OpenAI-compatible HTTP with /health and /metrics (uvicorn), and prints
`gateway ready on HOST:GRPC_PORT openai=HOST:HTTP_PORT` once both accept calls, or
`gateway failed to start: <cause>`. SIGTERM drains: health turns NOT_SERVING (Envoy stops
sending), new requests get UNAVAILABLE, in-flight ones finish for up to `--drain-timeout-s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import prometheus_client
import uvicorn

from services import lifecycle, tracing
from services.gateway import restarts
from services.gateway.admission import AdmissionQueue
from services.gateway.api.grpc_api import InferenceServicer
from services.gateway.api.http_app import HttpApp
from services.gateway.api.messages_api import Messages
from services.gateway.api.openai_api import ChatCompletions, Completions
from services.gateway.api.response_store import ResponseStore
from services.gateway.api.responses_api import Responses
from services.gateway.api_keys import ApiKeys
from services.gateway.config import GatewayConfig
from services.gateway.frontend import Frontend
from services.gateway.prepare.requests import ServedModel
from services.gateway.pricing import Prices
from services.gateway.routing import policies
from services.gateway.routing.affinity import AffinityTable
from services.gateway.routing.endpoints import EndpointSet
from services.gateway.routing.kv_events import KVEventFeeds
from services.gateway.routing.mooncake_view import MooncakeView
from services.gateway.routing.prefix_index import PrefixIndex
from services.gateway.routing.store_view import StoreView
from services.gateway.worker_pool import WorkerPool
from services.kvcache.mooncake_pool import SCHEME
from tandem.v1 import inference_pb2_grpc


class _Uvicorn(uvicorn.Server):
    """uvicorn inside our event loop: signals are the gateway's to handle, not uvicorn's."""

    def capture_signals(self):
        return contextlib.nullcontext()


def _listen(host: str, port: int) -> socket.socket:
    # IPPROTO_TCP named, not left 0: asyncio turns Nagle off (TCP_NODELAY) only on sockets whose
    # proto says TCP, and accepted ones inherit it. With Nagle on, a response written in two
    # parts (headers, then body or a first SSE chunk) waited ~40 ms for the client's delayed ACK.
    sock = socket.socket(
        socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP
    )
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        raise lifecycle.PortInUse(
            f"cannot listen on {host}:{port} (is the port already taken?)"
        ) from None
    sock.listen(4096)
    return sock


def _store_view(kv_store: str, host: str) -> StoreView | MooncakeView | None:
    """What the KV store holds, for routing: the built-in store's event feed, or a Mooncake
    pool's existence queries."""
    if not kv_store:
        return None
    return MooncakeView(kv_store, host) if kv_store.startswith(SCHEME) else StoreView(kv_store)


async def serve(config: GatewayConfig) -> None:
    index = PrefixIndex()
    feeds = KVEventFeeds(index)
    endpoints = EndpointSet(
        {"both": config.workers, "prefill": config.prefill, "decode": config.decode},
        config.workers_file,
        on_join=feeds.watch,
        on_leave=feeds.forget,
        on_stopped_answering=feeds.resync,
    )
    policy = policies.create(
        config.router, index, config.kv_prefill_weight, config.kv_decode_weight
    )
    pool = WorkerPool(
        endpoints,
        config.request_timeout_s,
        config.prefill_timeout_s,
        policy,
        AffinityTable(config.max_sessions, config.session_ttl_s),
        _store_view(config.kv_store, config.host),
    )
    admission = AdmissionQueue(pool.capacity, config.max_queued_requests, config.queue_timeout_s)
    endpoints.on_change = admission.wake
    service = lifecycle.GrpcService("gateway", config.host, config.port)
    try:
        keys = ApiKeys(config.api_keys_file) if config.api_keys_file else None
        model = ServedModel.from_folder(
            config.model, config.tool_call_parser, config.reasoning_parser, config.trust_remote_code
        )
        frontend = Frontend(model, pool, admission, Prices.parse(config.prices), keys)
        inference_pb2_grpc.add_InferenceServicer_to_server(
            InferenceServicer(frontend), service.server
        )
        service.bind()
        http_socket = _listen(config.host, config.http_port)
    except Exception as exc:
        lifecycle.fail_start("gateway", exc)
    prometheus_client.disable_created_metrics()
    if config.restarts_file:
        restarts.export(config.restarts_file)
    await endpoints.start()
    surfaces = [
        ChatCompletions(frontend),
        Completions(frontend),
        Responses(
            frontend, ResponseStore(config.max_stored_responses, config.stored_response_ttl_s)
        ),
        Messages(frontend),
    ]
    http = _Uvicorn(
        uvicorn.Config(
            HttpApp(frontend, surfaces).app,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=1,
            backlog=4096,
        )
    )
    http_task = asyncio.create_task(http.serve(sockets=[http_socket]))
    while not http.started and not http_task.done():
        await asyncio.sleep(0.01)
    await service.start(openai=f"{config.host}:{http_socket.getsockname()[1]}")

    await service.stopped(
        draining=frontend.drain,
        busy=lambda: frontend.num_in_flight,
        drain_timeout_s=config.drain_timeout_s,
    )
    http.should_exit = True
    await service.stop(grace=1)
    await http_task
    feeds.close()
    if pool.store is not None:
        await pool.store.close()
    await pool.close()
    tracing.shutdown()


def main() -> None:
    lifecycle.run(
        "gateway", GatewayConfig.from_args, serve, setup=lambda: tracing.setup("tandem-gateway")
    )


if __name__ == "__main__":
    main()
