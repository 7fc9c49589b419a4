"""Runs one worker process: the engine, its loop thread, and the grpc.aio server.

Each role's entry point calls `serve` with the servicers of its role. Prints
`<role> ready on HOST:PORT metrics=HOST:PORT [kv=ADDRESS]` on stdout once it accepts calls
(the launcher and the tests read the addresses from that line), or
`<role> failed to start: <cause>`.

Every role serves `grpc.health.v1` (SERVING until it drains), its Worker.Health, and
Prometheus metrics. SIGTERM drains: new requests are refused (UNAVAILABLE, so the gateway
retries them elsewhere; a decode worker refuses new KV), the gateway's next health poll sees
`draining` and routes around it, in-flight streams run to the end for up to
`--drain-timeout-s`, then the process exits.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

import grpc

from engine.cpu import pin_process
from engine.llm_engine import LLMEngine
from services import lifecycle, tracing
from services.decode.kv_inbox import KVInbox
from services.kvcache.mooncake_pool import SCHEME
from services.kvtransfer import create_receiver
from services.worker import metrics
from services.worker.calls import WorkerState
from services.worker.config import WorkerConfig
from services.worker.draft_client import RemoteDrafter
from services.worker.engine_loop import EngineLoop
from services.worker.kv_store import StoreConnector
from services.worker.mooncake_store import MooncakeConnector
from services.worker.servicer import WorkerServicer
from tandem.v1 import worker_pb2_grpc

log = logging.getLogger(__name__)
NAMES = {"both": "worker", "prefill": "prefill", "decode": "decode"}

# Adds a role's servicers to the server (and sets state.kv_address where it has one);
# returns a cleanup callable.
AddRole = Callable[[grpc.aio.Server, WorkerState, WorkerConfig], Callable[[], None]]


def serve(role: str, add_role: AddRole | None = None) -> None:
    name = NAMES[role]
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = WorkerConfig.from_args(role)
        engine = LLMEngine(config.engine)
        if config.cpu_list:  # after the engine: parallel ranks it started keep their own CPUs
            pin_process(config.cpu_list)
            log.info("pinned to CPUs %s", config.cpus)
        if config.draft:
            engine.attach_drafter(RemoteDrafter(config.draft))
    except Exception as exc:
        lifecycle.fail_start(name, exc)
    tracing.setup(f"tandem-{name}")
    asyncio.run(_serve(name, config, engine, add_role))


def _connect_store(
    state: WorkerState, config: WorkerConfig, cleanup: Callable[[], None]
) -> Callable[[], None]:
    """A KV receiver for blocks loaded from the store (a decode worker's serves both), and the
    store connector. Returns the cleanup of both. A Mooncake pool needs no receiver: the
    connector reads the blocks itself."""
    if config.kv_store.startswith(SCHEME):
        state.kv_store = MooncakeConnector(
            config.kv_store,
            state.loop,
            config.engine.model,
            config.host,
            replica_num=config.kv_store_replicas,
        )

        def close_mooncake() -> None:
            cleanup()
            state.kv_store.close()

        return close_mooncake
    receiver = None
    if state.kv_inbox is None:
        state.kv_inbox = KVInbox(state.loop, landed_ttl_s=config.kv_timeout_s)
        receiver = create_receiver(
            config.kv_transport, state.kv_inbox.on_header, state.kv_inbox.on_done
        )
        state.kv_address = receiver.start(config.host)
    state.kv_store = StoreConnector(
        config.kv_store, state.loop, state.kv_inbox, state.kv_address, config.engine.model
    )

    def close() -> None:
        cleanup()
        if receiver is not None:
            receiver.close()
            state.kv_inbox.close()
        state.kv_store.senders.close()

    return close


async def _serve(
    name: str, config: WorkerConfig, engine: LLMEngine, add_role: AddRole | None
) -> None:
    loop = EngineLoop(engine)
    model_name = os.path.basename(os.path.normpath(config.engine.model))
    state = WorkerState(loop, model_name, config.role, config.engine.max_num_seqs)
    state.speculative = (
        f"draft service {config.draft}" if config.draft else config.engine.speculative
    )
    service = lifecycle.GrpcService(name, config.host, config.port)
    try:
        cleanup = add_role(service.server, state, config) if add_role else (lambda: None)
        worker_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(state), service.server)
        if config.kv_store:
            cleanup = _connect_store(state, config, cleanup)
        service.bind()
        metrics_address = lifecycle.start_metrics(
            config.host, config.metrics_port, metrics.REGISTRY
        )
    except Exception as exc:
        lifecycle.fail_start(name, exc)
    loop.kv_events.event_loop = asyncio.get_running_loop()
    loop.start()
    await service.start(metrics=metrics_address, kv=state.kv_address)

    await service.stopped(
        draining=state.drain, busy=state.num_in_flight, drain_timeout_s=config.drain_timeout_s
    )
    loop.stop()  # ends every stream still open with UNAVAILABLE
    await service.stop(grace=1)
    cleanup()
    tracing.shutdown()
