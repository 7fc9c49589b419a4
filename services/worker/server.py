"""Runs one worker process: the engine, its loop thread, and the gRPC server.

Each role's entry point calls `serve` with the servicers of its role. Prints
`<role> ready on HOST:PORT` on stdout once it accepts calls (the launcher and the tests read
the port from that line). SIGINT/SIGTERM stop it: in-flight streams end with UNAVAILABLE
rather than hanging.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from concurrent import futures
from typing import Callable

import grpc

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from services.worker.config import WorkerConfig
from services.worker.engine_loop import EngineLoop
from services.worker.servicer import WorkerServicer
from tandem.v1 import worker_pb2_grpc

MAX_CONCURRENT_STREAMS = 256

# Adds a role's servicers to the server; returns (kv_address or "", a cleanup callable).
AddRole = Callable[[grpc.Server, EngineLoop, WorkerConfig], tuple[str, Callable[[], None]]]


def serve(role: str, add_role: AddRole | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s")
    config = WorkerConfig.from_args(role)
    engine = LLMEngine(EngineConfig(
        model=config.model, dtype=config.dtype, role=config.role, kv_cache_bytes=config.kv_cache_bytes,
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
    ))
    loop = EngineLoop(engine)
    loop.start()
    # Each stream holds a handler thread; beyond the cap gRPC answers RESOURCE_EXHAUSTED.
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=MAX_CONCURRENT_STREAMS + 8),
        maximum_concurrent_rpcs=MAX_CONCURRENT_STREAMS,
    )
    kv_address, cleanup = add_role(server, loop, config) if add_role else ("", lambda: None)
    name = os.path.basename(os.path.normpath(config.model))
    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(loop, name, config.role, kv_address), server)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    server.start()
    print(f"{role} ready on {config.host}:{port}" + (f" kv={kv_address}" if kv_address else ""), flush=True)

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    loop.stop()  # ends every open stream with UNAVAILABLE
    server.stop(grace=2).wait()
    cleanup()
