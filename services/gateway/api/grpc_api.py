"""The public Inference gRPC service (grpc.aio): protobuf requests in, OpenAI-shaped
completions and chunks out. Protobuf is converted here, at the edge; the frontend sees
only the gateway's own types (protocol.py)."""

from __future__ import annotations

import time
from typing import Optional

import grpc
from google.protobuf import json_format

from services import tracing
from services.gateway.errors import GatewayError
from services.gateway.frontend import Frontend
from services.gateway.output.tool_streams import call_deltas_json
from services.gateway.prepare import requests
from services.gateway.pricing import Prices
from services.gateway.protocol import (
    ChatRequest, CompletionRequest, Delta, Finish, SamplingOptions, TokenLogprob, Usage, Usages,
)
from tandem.v1 import inference_pb2, inference_pb2_grpc


def canonical(value):
    """JSON-shaped data with every object's keys sorted. A protobuf `Struct` keeps no key order
    (its map iterates in an order that may change from process to process), so what came
    through one is put in one fixed order before it can reach a prompt: the same request then
    renders the same tokens in every gateway, and prefix caches hit across replicas."""
    if isinstance(value, dict):
        return {key: canonical(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [canonical(v) for v in value]
    return value


def _dict(msg) -> dict:
    return canonical(json_format.MessageToDict(msg, preserving_proto_field_name=True))


def _value(msg, name: str):
    return canonical(json_format.MessageToDict(getattr(msg, name))) if msg.HasField(name) else None


def _optional(msg, name: str):
    return getattr(msg, name) if msg.HasField(name) else None


def _stop(msg) -> tuple[str, ...]:
    value = _value(msg, "stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, "stop must be a string or a list of strings")
    return tuple(stops)


def sampling_options(msg, max_tokens: Optional[int]) -> SamplingOptions:
    return SamplingOptions(
        max_tokens=max_tokens, temperature=_optional(msg, "temperature"), top_p=_optional(msg, "top_p"),
        top_k=_optional(msg, "top_k") or 0, min_p=_optional(msg, "min_p") or 0.0, seed=_optional(msg, "seed"),
        stop=_stop(msg), ignore_eos=getattr(msg, "ignore_eos", False), logprobs=getattr(msg, "logprobs", False),
        top_logprobs=(_optional(msg, "top_logprobs") or 0) if "top_logprobs" in msg.DESCRIPTOR.fields_by_name else 0,
        prediction=requests.prediction_text(_dict(msg.prediction) if msg.HasField("prediction") else None),
    )


def chat_request(msg: inference_pb2.ChatCompletionRequest, session: str = "") -> ChatRequest:
    max_tokens = _optional(msg, "max_completion_tokens") or _optional(msg, "max_tokens")
    return ChatRequest(
        messages=[_dict(m) for m in msg.messages],
        options=sampling_options(msg, max_tokens), model=msg.model,
        tools=[_dict(t) for t in msg.tools] or None,
        tool_choice=_value(msg, "tool_choice"), n=_optional(msg, "n") or 1, session=session,
        response_format=_value(msg, "response_format"),
    )


def completion_request(msg: inference_pb2.CompletionRequest, session: str = "") -> CompletionRequest:
    prompts = [list(msg.prompt_token_ids)] if msg.prompt_token_ids else [msg.prompt]
    return CompletionRequest(prompts=prompts, options=sampling_options(msg, _optional(msg, "max_tokens")),
                             model=msg.model, n=_optional(msg, "n") or 1, session=session)


def usage_message(usage: Usage, prices: Optional[Prices]) -> inference_pb2.Usage:
    message = inference_pb2.Usage(
        prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens, total_tokens=usage.total_tokens,
        prompt_tokens_details=inference_pb2.PromptTokensDetails(
            cached_tokens=usage.cached_tokens,
            cached_tokens_by_tier=inference_pb2.CachedTokensByTier(**usage.cached_tokens_by_tier())),
        completion_tokens_details=inference_pb2.CompletionTokensDetails(
            accepted_prediction_tokens=usage.accepted_prediction_tokens,
            rejected_prediction_tokens=usage.rejected_prediction_tokens, reasoning_tokens=usage.reasoning_tokens),
    )
    if prices is not None:
        message.cost = prices.cost(usage)
        message.cost_details.CopyFrom(inference_pb2.CostDetails(**prices.cost_details(usage)))
    return message


def tool_call_messages(calls, first_index: int = 0) -> list[inference_pb2.ToolCall]:
    return [
        inference_pb2.ToolCall(index=first_index + i, id=c.id, type="function",
                               function=inference_pb2.FunctionCall(name=c.name, arguments=c.arguments))
        for i, c in enumerate(calls)
    ]


def call_delta_messages(deltas) -> list[inference_pb2.ToolCall]:
    """A chunk's call steps as OpenAI streams them (openai_api.call_deltas_json)."""
    return [inference_pb2.ToolCall(index=c["index"], id=c.get("id", ""), type=c.get("type", ""),
                                   function=inference_pb2.FunctionCall(**c["function"]))
            for c in call_deltas_json(deltas)]


def logprobs_message(logprobs: list[TokenLogprob]) -> inference_pb2.ChoiceLogprobs:
    return inference_pb2.ChoiceLogprobs(content=[
        inference_pb2.TokenLogprob(token=lp.token, logprob=lp.logprob, bytes=list(lp.token.encode()), top_logprobs=[
            inference_pb2.TopLogprob(token=t, logprob=v, bytes=list(t.encode())) for t, v in lp.top])
        for lp in logprobs])


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, frontend: Frontend):
        self.frontend = frontend

    @property
    def model(self):
        return self.frontend.model

    def _caller(self, context: grpc.aio.ServicerContext):
        """The caller the `authorization` metadata names (None without keys); raises UNAUTHENTICATED."""
        return self.frontend.authenticate(_metadata(context, "authorization"))

    def _events(self, prepared, span_name: str, context: grpc.aio.ServicerContext, caller):
        return self.frontend.events(prepared, span_name, tracing.extract(context.invocation_metadata()), caller)

    async def CreateChatCompletion(self, request, context):
        async with _status(context):
            caller = self._caller(context)
            prepared = requests.chat(chat_request(request, _session(context)), self.model)
            choices = [_ChatChoice() for _ in prepared.generations]
            usages = Usages(prepared.n)
            async for event in self._events(prepared, "chat.completions", context, caller):
                choices[event.index].add(event)
                if isinstance(event, Finish):
                    usages.add(event)
            return inference_pb2.ChatCompletion(
                id=prepared.request_id, object="chat.completion", created=int(time.time()), model=self.model.name,
                usage=usage_message(usages.total(), self.frontend.prices), choices=[c.message(i) for i, c in enumerate(choices)])

    async def StreamChatCompletion(self, request, context):
        async with _status(context):
            caller = self._caller(context)
            prepared = requests.chat(chat_request(request, _session(context)), self.model)
            head = dict(id=prepared.request_id, object="chat.completion.chunk", created=int(time.time()),
                        model=self.model.name)

            def chunk(index: int, delta: inference_pb2.ChatDelta, finish_reason: str = "", logprobs=None):
                choice = inference_pb2.ChatChunkChoice(index=index, delta=delta, finish_reason=finish_reason)
                if logprobs:
                    choice.logprobs.CopyFrom(logprobs_message(logprobs))
                return inference_pb2.ChatCompletionChunk(**head, choices=[choice])

            for index in range(len(prepared.generations)):
                yield chunk(index, inference_pb2.ChatDelta(role="assistant"))
            usages = Usages(prepared.n)
            async for event in self._events(prepared, "chat.completions", context, caller):
                if isinstance(event, Finish):
                    usages.add(event)
                    yield chunk(event.index, inference_pb2.ChatDelta(), event.reason)
                    continue
                calls = call_delta_messages(event.call_deltas)
                if event.text or event.reasoning or calls or event.logprobs:
                    yield chunk(event.index, inference_pb2.ChatDelta(
                        content=event.text, reasoning_content=event.reasoning, tool_calls=calls),
                        logprobs=event.logprobs)
            if request.stream_options.include_usage:
                yield inference_pb2.ChatCompletionChunk(**head, usage=usage_message(usages.total(), self.frontend.prices))

    async def CreateCompletion(self, request, context):
        async with _status(context):
            caller = self._caller(context)
            prepared = requests.completion(completion_request(request, _session(context)), self.model)
            texts = [[] for _ in prepared.generations]
            reasons = [""] * len(prepared.generations)
            usages = Usages(prepared.n)
            async for event in self._events(prepared, "completions", context, caller):
                if isinstance(event, Delta):
                    texts[event.index].append(event.text)
                else:
                    reasons[event.index] = event.reason
                    usages.add(event)
            return inference_pb2.Completion(
                id=prepared.request_id, object="text_completion", created=int(time.time()), model=self.model.name,
                usage=usage_message(usages.total(), self.frontend.prices),
                choices=[inference_pb2.CompletionChoice(index=i, text="".join(t), finish_reason=r)
                         for i, (t, r) in enumerate(zip(texts, reasons))])

    async def StreamCompletion(self, request, context):
        async with _status(context):
            caller = self._caller(context)
            prepared = requests.completion(completion_request(request, _session(context)), self.model)
            head = dict(id=prepared.request_id, object="text_completion", created=int(time.time()),
                        model=self.model.name)
            usages = Usages(prepared.n)
            async for event in self._events(prepared, "completions", context, caller):
                if isinstance(event, Finish):
                    usages.add(event)
                    yield inference_pb2.CompletionChunk(
                        **head, choices=[inference_pb2.CompletionChoice(index=event.index, finish_reason=event.reason)])
                elif event.text:
                    yield inference_pb2.CompletionChunk(
                        **head, choices=[inference_pb2.CompletionChoice(index=event.index, text=event.text)])
            if request.stream_options.include_usage:
                yield inference_pb2.CompletionChunk(**head, usage=usage_message(usages.total(), self.frontend.prices))

    async def ListModels(self, request, context):
        async with _status(context):
            self._caller(context)
        model = inference_pb2.Model(id=self.model.name, object="model", created=0, owned_by="tandem",
                                    max_model_len=self.model.max_model_len)
        return inference_pb2.ListModelsResponse(object="list", data=[model])

    async def Health(self, request, context):
        """Readiness for anyone; with API keys, the workers (their addresses) only for a key holder."""
        pool = self.frontend.pool
        index = pool.policy.index
        endpoints = pool.endpoints.endpoints()
        ready = bool(pool.capacity()) and (not pool.disaggregated or bool(pool.endpoints.eligible("prefill")))
        workers = [inference_pb2.WorkerStatus(
            address=e.address, role=e.role, healthy=e.healthy and not e.draining,
            in_flight_prefill_tokens=e.in_flight_prefill_tokens, in_flight_decode_tokens=e.in_flight_decode_tokens,
            num_routed=e.num_routed, num_cached_blocks=index.num_blocks_of(e)) for e in endpoints]
        routing = inference_pb2.RoutingStatus(
            policy=pool.policy.name, num_indexed_blocks=len(index), num_index_lookups=index.num_lookups,
            num_index_hits=index.num_hits, num_sessions=len(pool.affinity), num_affinity_hits=pool.affinity.num_hits,
            num_affinity_misses=pool.affinity.num_misses)
        try:
            self._caller(context)
        except GatewayError:
            workers = []
        return inference_pb2.HealthCheckResponse(ready=ready, num_workers=len(endpoints), routing=routing,
                                                 num_healthy_workers=sum(e.healthy for e in endpoints), workers=workers)


def _metadata(context: grpc.aio.ServicerContext, name: str) -> str:
    return next((v for k, v in context.invocation_metadata() or () if k == name), "")


def _session(context: grpc.aio.ServicerContext) -> str:
    """The x-session-affinity metadata (REST clients' header, carried on by Envoy)."""
    return _metadata(context, requests.SESSION_HEADER)


class _ChatChoice:
    """A unary chat choice, gathered from its events."""

    def __init__(self):
        self.text, self.reasoning, self.calls, self.logprobs, self.reason = [], [], [], [], ""

    def add(self, event) -> None:
        if isinstance(event, Delta):
            self.text.append(event.text)
            self.reasoning.append(event.reasoning)
            self.calls += event.tool_calls
            self.logprobs += event.logprobs
        else:
            self.reason = event.reason

    def message(self, index: int) -> inference_pb2.ChatChoice:
        message = inference_pb2.ChatMessage(role="assistant", tool_calls=tool_call_messages(self.calls),
                                            reasoning_content="".join(self.reasoning))
        message.content.string_value = "".join(self.text)
        choice = inference_pb2.ChatChoice(index=index, message=message, finish_reason=self.reason)
        if self.logprobs:
            choice.logprobs.CopyFrom(logprobs_message(self.logprobs))
        return choice


class _status:
    """Ends the call with a GatewayError's status (and its retry hint in trailing metadata)."""

    def __init__(self, context: grpc.aio.ServicerContext):
        self.context = context

    async def __aenter__(self):
        return self

    async def __aexit__(self, kind, exc, tb):
        if isinstance(exc, GatewayError):
            if exc.retry_after_s:
                self.context.set_trailing_metadata((("retry-after", str(exc.retry_after_s)),))
            await self.context.abort(exc.code, exc.message)
        return False
