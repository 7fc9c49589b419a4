"""OpenAI's chat completion and completion replies, built from a request's events: the one
place they are made, for the HTTP surface (openai_api.py sends these dicts as JSON) and the
gRPC one (grpc_api.py writes the same dicts into its protobuf messages).

- Unary: each choice gathered whole (replies.py), then the reply with the request's usage.
- Streamed: a chunk for each event that carries something; each choice's role comes with its
  first event (a request refused while it waits in the queue has sent nothing yet), its
  finish reason in a chunk of its own, and with `include_usage` a last chunk with the usage
  and no choices.

Usage is OpenAI's, with the prompt's cached tokens (`prompt_tokens_details.cached_tokens`, and
by tier in tandem's `cached_tokens_by_tier`) and, where prices are set, `cost` and
`cost_details`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from services.gateway.api.replies import Reply, replies
from services.gateway.output.tool_streams import call_deltas_json
from services.gateway.prepare.requests import Prepared
from services.gateway.pricing import Prices
from services.gateway.protocol import Event, Finish, TokenLogprob, Usage, Usages


def usage_json(usage: Usage, prices: Prices | None) -> dict:
    body = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {
            "cached_tokens": usage.cached_tokens,
            "cached_tokens_by_tier": usage.cached_tokens_by_tier(),
        },
        "completion_tokens_details": {
            "accepted_prediction_tokens": usage.accepted_prediction_tokens,
            "rejected_prediction_tokens": usage.rejected_prediction_tokens,
            "reasoning_tokens": usage.reasoning_tokens,
        },
    }
    if prices is not None:
        body["cost"], body["cost_details"] = prices.cost(usage), prices.cost_details(usage)
    return body


def reasoning_json(reasoning: str) -> dict:
    """A message's (or delta's) reasoning, under DeepSeek's name and vLLM's current one."""
    return {"reasoning_content": reasoning, "reasoning": reasoning} if reasoning else {}


def tool_calls_json(calls, first_index: int = 0) -> list[dict]:
    return [
        {
            "index": first_index + i,
            "id": c.id,
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for i, c in enumerate(calls)
    ]


def chat_logprobs_json(logprobs: list[TokenLogprob]) -> dict:
    return {
        "content": [
            {
                "token": lp.token,
                "logprob": lp.logprob,
                "bytes": list(lp.token.encode()),
                "top_logprobs": [
                    {"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in lp.top
                ],
            }
            for lp in logprobs
        ]
    }


class CompletionLogprobs:
    """OpenAI's legacy completions logprobs: tokens, their logprobs, top alternatives, offsets."""

    def __init__(self):
        self.offset = 0

    def json(self, logprobs: list[TokenLogprob]) -> dict:
        offsets = []
        for lp in logprobs:
            offsets.append(self.offset)
            self.offset += len(lp.token)
        return {
            "tokens": [lp.token for lp in logprobs],
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [_first_of_each(lp.top) for lp in logprobs],
            "text_offset": offsets,
        }


def _first_of_each(top: list[tuple[str, float]]) -> dict[str, float]:
    """Token text -> logprob, most likely first. Two tokens may render alike (halves of one
    character): the likelier one stays."""
    out: dict[str, float] = {}
    for token, logprob in top:
        out.setdefault(token, logprob)
    return out


def _head(prepared: Prepared, model: str, kind: str) -> dict:
    return {"id": prepared.request_id, "object": kind, "created": int(time.time()), "model": model}


def _usage(choices: list[Reply], n: int, prices: Prices | None) -> dict:
    usages = Usages(n)
    for choice in choices:
        if choice.finish is not None:
            usages.add(choice.finish)
    return usage_json(usages.total(), prices)


def _reason(choice: Reply) -> str | None:
    return choice.finish.reason if choice.finish is not None else None


async def chat_completion(
    prepared: Prepared, model: str, prices: Prices | None, events: AsyncIterator[Event]
) -> dict:
    choices = await replies(events, len(prepared.generations))
    return {
        **_head(prepared, model, "chat.completion"),
        "usage": _usage(choices, prepared.n, prices),
        "choices": [
            {
                "index": i,
                "finish_reason": _reason(c),
                "logprobs": chat_logprobs_json(c.logprobs) if c.logprobs else None,
                "message": {
                    "role": "assistant",
                    "content": c.text,
                    **reasoning_json(c.reasoning),
                    **({"tool_calls": tool_calls_json(c.calls)} if c.calls else {}),
                },
            }
            for i, c in enumerate(choices)
        ],
    }


async def chat_chunks(
    prepared: Prepared,
    model: str,
    prices: Prices | None,
    events: AsyncIterator[Event],
    include_usage: bool,
) -> AsyncIterator[dict]:
    head = _head(prepared, model, "chat.completion.chunk")

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
            continue
        calls = call_deltas_json(event.call_deltas)
        # A chunk for every step's tokens, as vLLM sends them: one whose text is still held back
        # (a stop string forming, a character's first bytes) or special has empty content.
        delta = {"content": event.text} if event.text or not (event.reasoning or calls) else {}
        delta.update(reasoning_json(event.reasoning))
        if calls:
            delta["tool_calls"] = calls
        yield chunk(event.index, delta, logprobs=event.logprobs)
    if include_usage:
        yield {**head, "choices": [], "usage": usage_json(usages.total(), prices)}


async def completion(
    prepared: Prepared, model: str, prices: Prices | None, events: AsyncIterator[Event]
) -> dict:
    choices = await replies(events, len(prepared.generations))
    wants_logprobs = prepared.generations[0].sampling.logprobs
    return {
        **_head(prepared, model, "text_completion"),
        "usage": _usage(choices, prepared.n, prices),
        "choices": [
            {
                "index": i,
                "text": c.text,
                "finish_reason": _reason(c),
                "logprobs": CompletionLogprobs().json(c.logprobs) if wants_logprobs else None,
            }
            for i, c in enumerate(choices)
        ],
    }


async def completion_chunks(
    prepared: Prepared,
    model: str,
    prices: Prices | None,
    events: AsyncIterator[Event],
    include_usage: bool,
) -> AsyncIterator[dict]:
    head = _head(prepared, model, "text_completion")
    offsets = [CompletionLogprobs() for _ in prepared.generations]
    wants_logprobs = prepared.generations[0].sampling.logprobs
    usages = Usages(prepared.n)
    async for event in events:
        if isinstance(event, Finish):
            usages.add(event)
            yield {
                **head,
                "choices": [
                    {
                        "index": event.index,
                        "text": "",
                        "finish_reason": event.reason,
                        "logprobs": None,
                    }
                ],
            }
        else:  # a chunk for every step's tokens, its text empty while held back (see chat_chunks)
            logprobs = offsets[event.index].json(event.logprobs) if wants_logprobs else None
            yield {
                **head,
                "choices": [
                    {
                        "index": event.index,
                        "text": event.text,
                        "finish_reason": None,
                        "logprobs": logprobs,
                    }
                ],
            }
    if include_usage:
        yield {**head, "choices": [], "usage": usage_json(usages.total(), prices)}
