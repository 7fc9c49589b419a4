"""`python -m services.gateway --model DIR --workers HOST:PORT[,...]`: the public API.

Disaggregated: `--prefill HOST:PORT[,...] --decode HOST:PORT[,...]`; any set may also come
from `--workers-file` and `dns:NAME:PORT` entries (see services/gateway/endpoints.py).

Serves gRPC (tandem.v1.Inference) and OpenAI-compatible HTTP, and prints
`gateway ready on HOST:GRPC_PORT openai=HOST:HTTP_PORT` once both accept calls.
"""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures

import grpc

from services.gateway import openai_http
from services.gateway.config import GatewayConfig
from services.gateway.endpoints import EndpointSet
from services.gateway.requests import ServedModel
from services.gateway.servicer import InferenceServicer
from services.gateway.worker_pool import WorkerPool
from tandem.v1 import inference_pb2_grpc

MAX_CONCURRENT_STREAMS = 512


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s gateway %(levelname)s %(name)s: %(message)s")
    config = GatewayConfig.from_args()
    endpoints = EndpointSet({"both": config.workers, "prefill": config.prefill, "decode": config.decode},
                            config.workers_file)
    endpoints.start()
    pool = WorkerPool(endpoints, config.request_timeout_s, config.prefill_timeout_s)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=MAX_CONCURRENT_STREAMS + 8),
        maximum_concurrent_rpcs=MAX_CONCURRENT_STREAMS,
    )
    servicer = InferenceServicer(ServedModel.from_folder(config.model), pool)
    inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    server.start()
    http = openai_http.serve(servicer, config.host, config.http_port)
    print(f"gateway ready on {config.host}:{port} openai={config.host}:{http.server_address[1]}", flush=True)

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    http.shutdown()
    server.stop(grace=2).wait()
    pool.close()


if __name__ == "__main__":
    main()
