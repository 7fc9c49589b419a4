"""OpenAI's chat completions (`/v1/chat/completions`) and completions (`/v1/completions`)
as surfaces of the HTTP edge (http_app.py), and what the OpenAI-shaped surfaces share: the
error body with the HTTP status of the gRPC code (a refusal under load carries
`Retry-After`), usage with its cached tokens (and cost where prices are set), tool calls and
logprobs as OpenAI writes them. The body's `stream` field picks a unary reply or server-sent
events (`data: {...}` ... `data: [DONE]`), which a gRPC-JSON transcoder cannot express.
"""

from __future__ import annotations

import time
from typing import AsyncIterator, Optional

import grpc
from starlette.responses import JSONResponse

from services.gateway.api.http_app import Surface, parse_model
from services.gateway.api.openai_models import ChatCompletionBody, CompletionBody
from services.gateway.errors import GatewayError
from services.gateway.output.tool_streams import call_deltas_json
from services.gateway.prepare import requests
from services.gateway.pricing import Prices
from services.gateway.protocol import Delta, Event, Finish, TokenLogprob, Usage, Usages

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


def error_response(exc: GatewayError, status: int = 0) -> JSONResponse:
    code_status, body = error_body(exc)
    headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s else {}
    if exc.code == grpc.StatusCode.UNAUTHENTICATED:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(body, status_code=status or code_status, headers=headers or None)


def error_body(exc: GatewayError) -> tuple[int, dict]:
    status, kind = HTTP_STATUS.get(exc.code, (500, "internal_error"))
    code = "invalid_api_key" if exc.code == grpc.StatusCode.UNAUTHENTICATED else exc.code.name.lower()
    return status, {"error": {"message": exc.message, "type": kind, "param": None, "code": code}}


def usage_json(usage: Usage, prices: Optional[Prices]) -> dict:
    body = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens, "prompt_tokens_details": {"cached_tokens": usage.cached_tokens,
                                                               "cached_tokens_by_tier": usage.cached_tokens_by_tier()},
            "completion_tokens_details": {"accepted_prediction_tokens": usage.accepted_prediction_tokens,
                                          "rejected_prediction_tokens": usage.rejected_prediction_tokens,
                                          "reasoning_tokens": usage.reasoning_tokens}}
    if prices is not None:
        body["cost"], body["cost_details"] = prices.cost(usage), prices.cost_details(usage)
    return body


def reasoning_json(reasoning: str) -> dict:
    """A message's (or delta's) reasoning, under DeepSeek's name and vLLM's current one."""
    return {"reasoning_content": reasoning, "reasoning": reasoning} if reasoning else {}


def tool_calls_json(calls, first_index: int = 0) -> list[dict]:
    return [{"index": first_index + i, "id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for i, c in enumerate(calls)]


def chat_logprobs_json(logprobs: list[TokenLogprob]) -> dict:
    return {"content": [{"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token.encode()),
                         "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in lp.top]}
                        for lp in logprobs]}


class CompletionLogprobs:
    """OpenAI's legacy completions logprobs: tokens, their logprobs, top alternatives, offsets."""

    def __init__(self):
        self.offset = 0

    def json(self, logprobs: list[TokenLogprob]) -> dict:
        offsets = []
        for lp in logprobs:
            offsets.append(self.offset)
            self.offset += len(lp.token)
        return {"tokens": [lp.token for lp in logprobs], "token_logprobs": [lp.logprob for lp in logprobs],
                                "top_logprobs": [_first_of_each(lp.top) for lp in logprobs], "text_offset": offsets}


def _first_of_each(top: list[tuple[str, float]]) -> dict[str, float]:
    """Token text -> logprob, most likely first. Two tokens may render alike (halves of one
    character): the likelier one stays."""
    out: dict[str, float] = {}
    for token, logprob in top:
        out.setdefault(token, logprob)
    return out



class OpenAISurface(Surface):
    """What OpenAI's surfaces share: its error shape, and `[DONE]` after a stream."""

    done = b"data: [DONE]\n\n"

    def error_response(self, exc: GatewayError, status: int = 0) -> JSONResponse:
        return error_response(exc, status)

    def error_event(self, exc: GatewayError) -> dict:
        return error_body(exc)[1]

    def usage(self, usages: Usages) -> dict:
        return usage_json(usages.total(), self.frontend.prices)


class ChatCompletions(OpenAISurface):
    path = "/v1/chat/completions"
    span_name = "chat.completions"

    def parse(self, body: dict) -> ChatCompletionBody:
        return parse_model(ChatCompletionBody, body)

    def prepare(self, parsed: ChatCompletionBody, session: str) -> requests.Prepared:
        return requests.chat(parsed.to_request(session), self.model)

    async def unary(self, prepared, parsed: ChatCompletionBody, events) -> dict:
        choices = [{"index": i, "text": [], "reasoning": [], "calls": [], "logprobs": [], "reason": None}
                   for i in range(len(prepared.generations))]
        usages = Usages(prepared.n)
        async for event in events:
            choice = choices[event.index]
            if isinstance(event, Delta):
                choice["text"].append(event.text)
                choice["reasoning"].append(event.reasoning)
                choice["calls"] += event.tool_calls
                choice["logprobs"] += event.logprobs
            else:
                choice["reason"] = event.reason
                usages.add(event)
        return {"id": prepared.request_id, "object": "chat.completion", "created": int(time.time()),
                "model": self.model.name, "usage": self.usage(usages), "choices": [{
                    "index": c["index"], "finish_reason": c["reason"],
                    "logprobs": chat_logprobs_json(c["logprobs"]) if c["logprobs"] else None,
                    "message": {"role": "assistant", "content": "".join(c["text"]),
                                **reasoning_json("".join(c["reasoning"])),
                                **({"tool_calls": tool_calls_json(c["calls"])} if c["calls"] else {})}}
                    for c in choices]}

    async def chunks(self, prepared, parsed: ChatCompletionBody, events: AsyncIterator[Event]):
        head = {"id": prepared.request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model.name}

        def chunk(index: int, delta: dict, finish_reason=None, logprobs=None) -> dict:
            choice = {"index": index, "delta": delta, "finish_reason": finish_reason}
            if logprobs:
                choice["logprobs"] = chat_logprobs_json(logprobs)
            return {**head, "choices": [choice]}

        usages = Usages(prepared.n)
        started = set()
        async for event in events:
            if event.index not in started:  # the role comes with the choice's first event
                started.add(event.index)
                yield chunk(event.index, {"role": "assistant", "content": ""})
            if isinstance(event, Finish):
                usages.add(event)
                yield chunk(event.index, {}, event.reason)
            else:
                calls = call_deltas_json(event.call_deltas)
                if not (event.text or event.reasoning or calls or event.logprobs):
                    continue
                delta = {"content": event.text} if event.text else {}
                delta.update(reasoning_json(event.reasoning))
                if calls:
                    delta["tool_calls"] = calls
                yield chunk(event.index, delta, logprobs=event.logprobs)
        if parsed.include_usage:
            yield {**head, "choices": [], "usage": self.usage(usages)}


class Completions(OpenAISurface):
    path = "/v1/completions"
    span_name = "completions"

    def parse(self, body: dict) -> CompletionBody:
        return parse_model(CompletionBody, body)

    def prepare(self, parsed: CompletionBody, session: str) -> requests.Prepared:
        return requests.completion(parsed.to_request(session), self.model)

    async def unary(self, prepared, parsed: CompletionBody, events) -> dict:
        choices = [{"index": i, "text": [], "logprobs": [], "reason": None} for i in range(len(prepared.generations))]
        usages = Usages(prepared.n)
        async for event in events:
            choice = choices[event.index]
            if isinstance(event, Delta):
                choice["text"].append(event.text)
                choice["logprobs"] += event.logprobs
            else:
                choice["reason"] = event.reason
                usages.add(event)
        wants_logprobs = prepared.generations[0].sampling.logprobs
        return {"id": prepared.request_id, "object": "text_completion", "created": int(time.time()),
                "model": self.model.name, "usage": self.usage(usages), "choices": [{
                    "index": c["index"], "text": "".join(c["text"]), "finish_reason": c["reason"],
                    "logprobs": CompletionLogprobs().json(c["logprobs"]) if wants_logprobs else None}
                    for c in choices]}

    async def chunks(self, prepared, parsed: CompletionBody, events: AsyncIterator[Event]):
        head = {"id": prepared.request_id, "object": "text_completion", "created": int(time.time()),
                "model": self.model.name}
        offsets = [CompletionLogprobs() for _ in prepared.generations]
        wants_logprobs = prepared.generations[0].sampling.logprobs
        usages = Usages(prepared.n)
        async for event in events:
            if isinstance(event, Finish):
                usages.add(event)
                yield {**head, "choices": [{"index": event.index, "text": "", "finish_reason": event.reason,
                                            "logprobs": None}]}
            elif event.text or event.logprobs:
                logprobs = offsets[event.index].json(event.logprobs) if wants_logprobs else None
                yield {**head, "choices": [{"index": event.index, "text": event.text, "finish_reason": None,
                                            "logprobs": logprobs}]}
        if parsed.include_usage:
            yield {**head, "choices": [], "usage": self.usage(usages)}
