"""The Worker gRPC service over an EngineLoop: Generate (colocated role) and Health (all)."""

from __future__ import annotations

import queue
import uuid

import grpc

from engine.errors import InvalidRequestError
from services.worker import convert
from services.worker.engine_loop import EngineFailed, EngineLoop, WorkerStopped
from tandem.v1 import worker_pb2, worker_pb2_grpc


def admit_or_abort(context: grpc.ServicerContext, loop: EngineLoop, request_id: str, admit) -> queue.SimpleQueue:
    """Submits a request; a refusal ends the call with the matching status. Cancelling the
    call later aborts the request (a no-op once it has finished)."""
    try:
        stream = loop.submit(request_id, admit)
    except InvalidRequestError as exc:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    except WorkerStopped as exc:
        context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
    context.add_callback(lambda: loop.abort(request_id))
    return stream


def sampling_or_abort(context: grpc.ServicerContext, msg: worker_pb2.SamplingParams):
    try:
        return convert.sampling_params(msg)
    except InvalidRequestError as exc:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


def add_request_or_abort(context: grpc.ServicerContext, loop: EngineLoop, request_id: str, request) -> queue.SimpleQueue:
    """Queues a Generate or Prefill request (prompt ids + sampling) on the engine."""
    params = sampling_or_abort(context, request.sampling)
    prompt = list(request.prompt_token_ids)
    return admit_or_abort(context, loop, request_id, lambda: loop.engine.add_request(request_id, prompt, params))


def next_output(context: grpc.ServicerContext, stream: queue.SimpleQueue):
    """The next RequestOutput, or the call ends with the status of what stopped the request."""
    item = stream.get()
    if isinstance(item, WorkerStopped):
        context.abort(grpc.StatusCode.UNAVAILABLE, str(item))
    if isinstance(item, EngineFailed):
        context.abort(grpc.StatusCode.INTERNAL, str(item))
    return item


def stream_responses(context: grpc.ServicerContext, stream: queue.SimpleQueue):
    """Yields GenerateResponses until the request finishes."""
    while True:
        out = next_output(context, stream)
        yield convert.generate_response(out)
        if out.finished:
            return


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, loop: EngineLoop, model_name: str, role: str, kv_address: str = ""):
        self.loop = loop
        self.model_name = model_name
        self.role = role
        self.kv_address = kv_address

    def Generate(self, request: worker_pb2.GenerateRequest, context: grpc.ServicerContext):
        if self.role != "both":
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"this is a {self.role} worker; Generate runs on colocated workers")
        stream = add_request_or_abort(context, self.loop, request.request_id or uuid.uuid4().hex, request)
        yield from stream_responses(context, stream)

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
            kv_address=self.kv_address,
            num_requests=self.loop.num_requests,
        )
