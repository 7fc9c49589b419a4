"""The public Inference gRPC service: requests in, OpenAI-shaped completions and chunks out."""

from __future__ import annotations

import time

from services.gateway import requests
from services.gateway.errors import GatewayError
from services.gateway.generation import Delta, Finish, Usage, generate
from services.gateway.worker_pool import WorkerPool
from tandem.v1 import inference_pb2, inference_pb2_grpc


def usage_message(usage: Usage) -> inference_pb2.Usage:
    return inference_pb2.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.prompt_tokens + usage.completion_tokens,
        prompt_tokens_details=inference_pb2.PromptTokensDetails(cached_tokens=usage.cached_tokens),
    )


def tool_call_messages(calls, first_index: int = 0) -> list[inference_pb2.ToolCall]:
    return [
        inference_pb2.ToolCall(index=first_index + i, id=c.id, type="function",
                               function=inference_pb2.FunctionCall(name=c.name, arguments=c.arguments))
        for i, c in enumerate(calls)
    ]


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, model: requests.ServedModel, pool: WorkerPool):
        self.model = model
        self.pool = pool

    def _events(self, worker_request, parse_tools: bool, context):
        return generate(self.pool, self.model.tokenizer, worker_request, parse_tools,
                        on_cancel=lambda cancel: context.add_callback(cancel))

    def CreateChatCompletion(self, request, context):
        with _status(context):
            worker_request, parse_tools = requests.chat_request(request, self.model)
            text, calls = [], []
            for event in self._events(worker_request, parse_tools, context):
                if isinstance(event, Delta):
                    text.append(event.text)
                    calls += event.tool_calls
                else:
                    finish = event
            message = inference_pb2.ChatMessage(role="assistant", tool_calls=tool_call_messages(calls))
            message.content.string_value = "".join(text)
            return inference_pb2.ChatCompletion(
                id=worker_request.request_id, object="chat.completion", created=int(time.time()),
                model=self.model.name, usage=usage_message(finish.usage),
                choices=[inference_pb2.ChatChoice(index=0, message=message, finish_reason=finish.reason)],
            )

    def StreamChatCompletion(self, request, context):
        with _status(context):
            worker_request, parse_tools = requests.chat_request(request, self.model)
            head = dict(id=worker_request.request_id, object="chat.completion.chunk", created=int(time.time()),
                        model=self.model.name)

            def chunk(delta: inference_pb2.ChatDelta, finish_reason: str = ""):
                return inference_pb2.ChatCompletionChunk(
                    **head, choices=[inference_pb2.ChatChunkChoice(index=0, delta=delta, finish_reason=finish_reason)])

            yield chunk(inference_pb2.ChatDelta(role="assistant"))
            num_calls = 0
            for event in self._events(worker_request, parse_tools, context):
                if isinstance(event, Finish):
                    yield chunk(inference_pb2.ChatDelta(), event.reason)
                    if request.stream_options.include_usage:
                        yield inference_pb2.ChatCompletionChunk(**head, usage=usage_message(event.usage))
                elif event.text or event.tool_calls:
                    yield chunk(inference_pb2.ChatDelta(
                        content=event.text, tool_calls=tool_call_messages(event.tool_calls, num_calls)))
                    num_calls += len(event.tool_calls)

    def CreateCompletion(self, request, context):
        with _status(context):
            worker_request = requests.completion_request(request, self.model)
            text = []
            for event in self._events(worker_request, False, context):
                if isinstance(event, Delta):
                    text.append(event.text)
                else:
                    finish = event
            return inference_pb2.Completion(
                id=worker_request.request_id, object="text_completion", created=int(time.time()),
                model=self.model.name, usage=usage_message(finish.usage),
                choices=[inference_pb2.CompletionChoice(index=0, text="".join(text), finish_reason=finish.reason)],
            )

    def StreamCompletion(self, request, context):
        with _status(context):
            worker_request = requests.completion_request(request, self.model)
            head = dict(id=worker_request.request_id, object="text_completion", created=int(time.time()),
                        model=self.model.name)
            for event in self._events(worker_request, False, context):
                if isinstance(event, Finish):
                    yield inference_pb2.CompletionChunk(
                        **head, choices=[inference_pb2.CompletionChoice(index=0, finish_reason=event.reason)])
                    if request.stream_options.include_usage:
                        yield inference_pb2.CompletionChunk(**head, usage=usage_message(event.usage))
                elif event.text:
                    yield inference_pb2.CompletionChunk(
                        **head, choices=[inference_pb2.CompletionChoice(index=0, text=event.text)])

    def ListModels(self, request, context):
        model = inference_pb2.Model(id=self.model.name, object="model", created=0, owned_by="tandem",
                                    max_model_len=self.model.max_model_len)
        return inference_pb2.ListModelsResponse(object="list", data=[model])

    def Health(self, request, context):
        endpoints = self.pool.endpoints.endpoints()
        healthy = {e.role for e in endpoints if e.healthy}
        ready = {"prefill", "decode"} <= healthy if self.pool.disaggregated else "both" in healthy
        workers = [inference_pb2.WorkerStatus(
            address=e.address, role=e.role, healthy=e.healthy, in_flight_prefill_tokens=e.in_flight_prefill_tokens,
            in_flight_decode_tokens=e.in_flight_decode_tokens, num_routed=e.num_routed) for e in endpoints]
        return inference_pb2.HealthCheckResponse(ready=ready, num_workers=len(endpoints),
                                                 num_healthy_workers=sum(e.healthy for e in endpoints), workers=workers)


class _status:
    """Turns a GatewayError raised inside a handler into the call's gRPC status."""

    def __init__(self, context):
        self.context = context

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if isinstance(exc, GatewayError):
            self.context.abort(exc.code, exc.message)
        return False
