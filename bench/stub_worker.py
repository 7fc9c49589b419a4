"""A stand-in colocated worker for measuring the gateway alone: the real Worker gRPC API with
no engine behind it, so thousands of streams cost the worker nothing.

    .venv/bin/python bench/stub_worker.py [--port 0]   # prints `worker ready on HOST:PORT`

`Generate` streams `max_tokens` tokens (a fixed cycle of ids), one every `top_k`
milliseconds (0: as fast as it can), then finishes with `length`. `Health` reports a batch
(`max_num_seqs`) of 100,000, so the gateway's admission never queues in front of it.
Benchmarks only: it is how bench/gateway.py isolates the gateway's own cost.
"""

from __future__ import annotations

import argparse
import asyncio
import os

import grpc

from tandem.v1 import worker_pb2, worker_pb2_grpc

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TOKENS = [72, 101, 108, 108, 111, 32]  # any ids the demo tokenizer decodes


class StubWorker(worker_pb2_grpc.WorkerServicer):
    async def Generate(self, request, context):
        interval = request.sampling.top_k / 1000
        n = request.sampling.max_tokens or 16
        for i in range(n):
            if interval:
                await asyncio.sleep(interval)
            yield worker_pb2.GenerateResponse(
                token_ids=[TOKENS[i % len(TOKENS)]],
                num_prompt_tokens=len(request.prompt_token_ids),
                finish_reason=worker_pb2.FINISH_REASON_LENGTH
                if i == n - 1
                else worker_pb2.FINISH_REASON_UNSPECIFIED,
            )

    async def Health(self, request, context):
        return worker_pb2.HealthResponse(
            model="stub",
            role="both",
            num_blocks=1 << 20,
            num_free_blocks=1 << 20,
            block_size=16,
            max_model_len=1 << 20,
            max_num_seqs=100_000,
        )


async def serve(port: int) -> None:
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(StubWorker(), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print(f"worker ready on 127.0.0.1:{bound}", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--port", type=int, default=0)
    asyncio.run(serve(parser.parse_args().port))
