"""The public Inference gRPC service (grpc.aio): protobuf requests in, OpenAI-shaped
completions and chunks out. Protobuf is converted here, at the edge; the frontend sees
only the gateway's own types (protocol.py). The replies are openai_replies.py's, the ones
the HTTP surface sends, written into their protobuf messages."""

from __future__ import annotations

import grpc
from google.protobuf import json_format

from services import tracing
from services.gateway.api import openai_replies
from services.gateway.errors import GatewayError
from services.gateway.frontend import Frontend
from services.gateway.prepare import requests
from services.gateway.protocol import ChatRequest, CompletionRequest, SamplingOptions
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
        raise GatewayError(
            grpc.StatusCode.INVALID_ARGUMENT, "stop must be a string or a list of strings"
        )
    return tuple(stops)


def sampling_options(msg, max_tokens: int | None) -> SamplingOptions:
    return SamplingOptions(
        max_tokens=max_tokens,
        temperature=_optional(msg, "temperature"),
        top_p=_optional(msg, "top_p"),
        top_k=_optional(msg, "top_k") or 0,
        min_p=_optional(msg, "min_p") or 0.0,
        seed=_optional(msg, "seed"),
        stop=_stop(msg),
        ignore_eos=getattr(msg, "ignore_eos", False),
        logprobs=getattr(msg, "logprobs", False),
        top_logprobs=(_optional(msg, "top_logprobs") or 0)
        if "top_logprobs" in msg.DESCRIPTOR.fields_by_name
        else 0,
        prediction=requests.prediction_text(
            _dict(msg.prediction) if msg.HasField("prediction") else None
        ),
    )


def chat_request(msg: inference_pb2.ChatCompletionRequest, session: str = "") -> ChatRequest:
    max_tokens = _optional(msg, "max_completion_tokens") or _optional(msg, "max_tokens")
    return ChatRequest(
        messages=[_dict(m) for m in msg.messages],
        options=sampling_options(msg, max_tokens),
        model=msg.model,
        tools=[_dict(t) for t in msg.tools] or None,
        tool_choice=_value(msg, "tool_choice"),
        n=_optional(msg, "n") or 1,
        session=session,
        response_format=_value(msg, "response_format"),
        cache_salt=msg.cache_salt,
    )


def completion_request(
    msg: inference_pb2.CompletionRequest, session: str = ""
) -> CompletionRequest:
    prompts = [list(msg.prompt_token_ids)] if msg.prompt_token_ids else [msg.prompt]
    return CompletionRequest(
        prompts=prompts,
        options=sampling_options(msg, _optional(msg, "max_tokens")),
        model=msg.model,
        n=_optional(msg, "n") or 1,
        session=session,
        cache_salt=msg.cache_salt,
    )


def message_from(data: dict, message):
    """`message` filled in from OpenAI's JSON (openai_replies.py), field by field. A key the
    message has no field for (the `reasoning` alias of reasoning_content, a completion's
    logprobs) or a null value is left out; a string for a `google.protobuf.Value` (a message's
    content) is its string_value. Returns `message`."""
    fields = message.DESCRIPTOR.fields_by_name
    for name, value in data.items():
        field = fields.get(name)
        if field is None or value is None:
            continue
        if field.message_type is None:
            if field.is_repeated:
                getattr(message, name).extend(value)
            else:
                setattr(message, name, value)
        elif field.message_type.full_name == "google.protobuf.Value":
            getattr(message, name).string_value = value
        elif field.is_repeated:
            for item in value:
                message_from(item, getattr(message, name).add())
        else:
            getattr(message, name).SetInParent()  # present even when empty: a finish chunk's delta
            message_from(value, getattr(message, name))
    return message


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
        return self.frontend.events(
            prepared, span_name, tracing.extract(context.invocation_metadata()), caller
        )

    async def CreateChatCompletion(self, request, context):
        async with _status(context):
            caller = self._caller(context)
            prepared = requests.chat(chat_request(request, _session(context)), self.model)
            events = self._events(prepared, "chat.completions", context, caller)
            reply = await openai_replies.chat_completion(
                prepared, self.model.name, self.frontend.prices, events
            )
            return message_from(reply, inference_pb2.ChatCompletion())

    async def StreamChatCompletion(self, request, context):
        async with _status(context):
            caller = self._caller(context)
            prepared = requests.chat(chat_request(request, _session(context)), self.model)
            events = self._events(prepared, "chat.completions", context, caller)
            async for chunk in openai_replies.chat_chunks(
                prepared,
                self.model.name,
                self.frontend.prices,
                events,
                request.stream_options.include_usage,
            ):
                yield message_from(chunk, inference_pb2.ChatCompletionChunk())

    async def CreateCompletion(self, request, context):
        async with _status(context):
            caller = self._caller(context)
            prepared = requests.completion(
                completion_request(request, _session(context)), self.model
            )
            events = self._events(prepared, "completions", context, caller)
            reply = await openai_replies.completion(
                prepared, self.model.name, self.frontend.prices, events
            )
            return message_from(reply, inference_pb2.Completion())

    async def StreamCompletion(self, request, context):
        async with _status(context):
            caller = self._caller(context)
            prepared = requests.completion(
                completion_request(request, _session(context)), self.model
            )
            events = self._events(prepared, "completions", context, caller)
            async for chunk in openai_replies.completion_chunks(
                prepared,
                self.model.name,
                self.frontend.prices,
                events,
                request.stream_options.include_usage,
            ):
                yield message_from(chunk, inference_pb2.CompletionChunk())

    async def ListModels(self, request, context):
        async with _status(context):
            self._caller(context)
        model = inference_pb2.Model(
            id=self.model.name,
            object="model",
            created=0,
            owned_by="tandem",
            max_model_len=self.model.max_model_len,
        )
        return inference_pb2.ListModelsResponse(object="list", data=[model])

    async def Health(self, request, context):
        """Readiness for anyone; with API keys, the workers (their addresses) only for a key holder."""
        pool = self.frontend.pool
        index = pool.policy.index
        endpoints = pool.endpoints.endpoints()
        ready = bool(pool.capacity()) and (
            not pool.disaggregated or bool(pool.endpoints.eligible("prefill"))
        )
        workers = [
            inference_pb2.WorkerStatus(
                address=e.address,
                role=e.role,
                healthy=e.healthy and not e.draining,
                in_flight_prefill_tokens=e.in_flight_prefill_tokens,
                in_flight_decode_tokens=e.in_flight_decode_tokens,
                num_routed=e.num_routed,
                num_cached_blocks=index.num_blocks_of(e),
            )
            for e in endpoints
        ]
        routing = inference_pb2.RoutingStatus(
            policy=pool.policy.name,
            num_indexed_blocks=len(index),
            num_index_lookups=index.num_lookups,
            num_index_hits=index.num_hits,
            num_sessions=len(pool.affinity),
            num_affinity_hits=pool.affinity.num_hits,
            num_affinity_misses=pool.affinity.num_misses,
        )
        try:
            self._caller(context)
        except GatewayError:
            workers = []
        return inference_pb2.HealthCheckResponse(
            ready=ready,
            num_workers=len(endpoints),
            routing=routing,
            num_healthy_workers=sum(e.healthy for e in endpoints),
            workers=workers,
        )


def _metadata(context: grpc.aio.ServicerContext, name: str) -> str:
    return next((v for k, v in context.invocation_metadata() or () if k == name), "")


def _session(context: grpc.aio.ServicerContext) -> str:
    """The x-session-affinity metadata (REST clients' header, carried on by Envoy)."""
    return _metadata(context, requests.SESSION_HEADER)


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
