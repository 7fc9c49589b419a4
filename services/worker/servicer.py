"""The Worker gRPC service over an EngineLoop."""

from __future__ import annotations

import uuid

import grpc

from engine.errors import InvalidRequestError
from services.worker import convert
from services.worker.engine_loop import EngineFailed, EngineLoop, WorkerStopped
from tandem.v1 import worker_pb2, worker_pb2_grpc


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, loop: EngineLoop, model_name: str, role: str):
        self.loop = loop
        self.model_name = model_name
        self.role = role

    def Generate(self, request: worker_pb2.GenerateRequest, context: grpc.ServicerContext):
        request_id = request.request_id or uuid.uuid4().hex
        try:
            params = convert.sampling_params(request.sampling)
            stream = self.loop.submit(request_id, list(request.prompt_token_ids), params)
        except InvalidRequestError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except WorkerStopped as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        # Runs when the RPC ends for any reason; after a normal finish the abort is a no-op.
        context.add_callback(lambda: self.loop.abort(request_id))
        while True:
            item = stream.get()
            if isinstance(item, WorkerStopped):
                context.abort(grpc.StatusCode.UNAVAILABLE, str(item))
            if isinstance(item, EngineFailed):
                context.abort(grpc.StatusCode.INTERNAL, str(item))
            yield convert.generate_response(item)
            if item.finished:
                return

    def Health(self, request: worker_pb2.HealthRequest, context: grpc.ServicerContext):
        engine = self.loop.engine
        return worker_pb2.HealthResponse(
            model=self.model_name,
            role=self.role,
            num_blocks=engine.num_blocks,
            num_free_blocks=engine.num_free_blocks,
            block_size=engine.config.block_size,
            num_running=len(engine.scheduler.running),
            num_waiting=len(engine.scheduler.waiting),
            max_model_len=engine.max_model_len,
            num_aborted=self.loop.num_aborted,
        )
