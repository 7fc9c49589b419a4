"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) as a
surface of the HTTP edge (http_app.py). Its fields sort three ways (docs/apis.md lists them):
- implemented, reduced to the gateway's chat request: `system` (a string or text blocks),
  `messages` of user, assistant and system turns whose content is a string or blocks: `text`,
  `tool_use` (assistant) and `tool_result` (user, with `is_error`); `tools` (custom tools:
  name, description, input_schema) and `tool_choice` (auto, any, tool, none); `max_tokens`
  (required; with the prompt over the context it is refused in Anthropic's own words, which
  Claude Code reads to retry with less), `stop_sequences`, `temperature`, `top_p`, `top_k`;
  `thinking` (enabled, adaptive: the template's thinking switch on; disabled: off);
  `output_config.format` (a JSON schema the reply follows, as structured outputs),
  `output_config.effort` (gpt-oss's `Reasoning:` level; other models ignore it); tandem's
  `cache_salt` (vLLM's: the prompt's cache shared only under the same salt);
- accepted and ignored, since they do not change the tokens: `metadata`, `context_management`,
  `service_tier`, `cache_control` marks (prefix caching is automatic),
  the `anthropic-beta` header and `?beta=true`. Server tools (web search and the like, which
  tandem cannot run) are left out of the prompt, named in an `x-tandem-warning` header;
- refused with Anthropic's error shape, `{"type": "error", "error": {"type": ..., "message":
  ...}}`, and its status: images, documents, `mcp_servers`, `container`, unknown fields.
The key comes in `x-api-key` or `Authorization: Bearer`, checked against the same keys as the
other APIs. A system block that is a client's per-request billing header
(`x-anthropic-billing-header: ...`, Claude Code's first) is dropped: it changes with every
prompt, so kept it would end the shared prefix (and the cache hit) at the first block.

Usage is Anthropic's: `input_tokens` are the prompt tokens not read from the cache,
`cache_read_input_tokens` those a worker's prefix cache served (billed at the discount), and
`output_tokens` (and tandem's `cost` where prices are set). Streamed, the events are message_start,
then per content block content_block_start, content_block_delta (text_delta, or input_json_delta for
a tool call's input) and content_block_stop, then message_delta (stop reason, usage) and
message_stop.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import JSONResponse
from starlette.routing import Route

from services.gateway.api.http_app import Surface, parse_model, read_body
from services.gateway.api.replies import one_reply
from services.gateway.errors import ContextLimit, GatewayError, invalid, unsupported_part
from services.gateway.output.tool_calls import ToolCall
from services.gateway.output.tool_streams import ARGUMENTS, START, CallDelta
from services.gateway.prepare import requests
from services.gateway.prepare.chat import function_tool, tool_call
from services.gateway.protocol import ChatRequest, Event, Finish, SamplingOptions, Usage

ERROR_TYPES = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (529, "overloaded_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "abort": "end_turn",
}


# System blocks a client sends for its own bookkeeping that change per request.
VOLATILE_SYSTEM_PREFIXES = ("x-anthropic-billing-header:",)


class MessagesBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int = Field(0, ge=0)  # required, except by count_tokens (checked in parse)
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    cache_control: dict[str, Any] | None = None  # top-level: a hint only, as everywhere here
    # Sampling settings the current API no longer takes (its SDK sends them as extra_body);
    # tandem keeps them, as vLLM does: temperature 0 is greedy.
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    service_tier: str | None = None
    # ignored: edits to thinking tandem does not keep
    context_management: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # format; effort (gpt-oss's reasoning level)
    cache_salt: str | None = None  # vLLM's, as in chat completions (tandem's extension here)


def _text_of(blocks: str | list, where: str) -> str:
    """A string, or text blocks joined (what `system` and `tool_result.content` hold)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise invalid(f"{where}: must be a string or a list of text blocks")
    texts = []
    for i, block in enumerate(blocks):
        if (
            not isinstance(block, dict)
            or block.get("type") != "text"
            or not isinstance(block.get("text"), str)
        ):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise unsupported_part(kind, f"{where}.{i}", "text")
        texts.append(block["text"])
    return "".join(texts)


def system_text(system: str | list | None) -> str:
    """`system` as text, without the blocks that change per request (VOLATILE_SYSTEM_PREFIXES)."""
    if isinstance(system, list):
        system = [
            b
            for b in system
            if not (
                isinstance(b, dict)
                and isinstance(b.get("text"), str)
                and b["text"].startswith(VOLATILE_SYSTEM_PREFIXES)
            )
        ]
    return _text_of(system, "system") if system else ""


def chat_messages(system: str | list | None, messages: list[dict]) -> list[dict]:
    """Anthropic's turns as chat messages: a user turn's tool results become tool messages
    (ahead of its text), an assistant turn's tool_use blocks its tool calls."""
    text = system_text(system)
    out = [{"role": "system", "content": text}] if text else []
    if not messages:
        raise invalid("messages: at least one message is required")
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant", "system"):
            raise invalid(f"{where}.role: must be user, assistant or system, not {role!r}")
        if role == "system":  # mid-conversation system text (Claude Code's context notes)
            out.append({"role": "system", "content": _text_of(content, f"{where}.content")})
            continue
        unknown = set(message) - {"role", "content"}
        if unknown:
            raise invalid(f"{where}.{sorted(unknown)[0]}: Extra inputs are not permitted")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise invalid(f"{where}.content: must be a string or a list of content blocks")
        texts, calls, thoughts = [], [], []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                if isinstance(
                    block.get("thinking"), str
                ):  # redacted: opaque to this server, dropped
                    thoughts.append(block["thinking"])
            elif kind == "tool_use" and role == "assistant":
                calls.append(
                    tool_call(
                        str(block.get("id", "")),
                        str(block.get("name", "")),
                        json.dumps(block.get("input") or {}),
                    )
                )
            elif kind == "tool_result" and role == "user":
                result = block.get("content", "")
                out.append(
                    {
                        "role": "tool",
                        "tool_call_id": str(block.get("tool_use_id", "")),
                        "content": _text_of(result, f"{where}.content.{j}.content"),
                        **({"is_error": True} if block.get("is_error") else {}),
                    }
                )
            else:
                raise unsupported_part(
                    kind,
                    f"{where}.content.{j}",
                    "text, tool_result" if role == "user" else "text, tool_use",
                )
        if texts or calls or thoughts:
            entry = {"role": role, "content": "".join(texts)}
            if thoughts:
                entry["reasoning_content"] = "".join(thoughts)
            if calls:
                entry["tool_calls"] = calls
            out.append(entry)
    return out


def chat_tools(tools: list[dict] | None) -> tuple[list[dict] | None, list[str]]:
    """(custom tools as function tools, the server tools left out)."""
    if not tools:
        return None, []
    out, left_out = [], []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise invalid(f"tools.{i}: must be an object")
        if (
            tool.get("type", "custom") != "custom"
        ):  # a server tool (web_search_20250305, ...): run by the server
            left_out.append(str(tool.get("name") or tool.get("type")))
            continue
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
            raise invalid(f"tools.{i}: a tool needs a name and an input_schema object")
        out.append(function_tool(tool["name"], tool.get("description", ""), tool["input_schema"]))
    return out or None, left_out


def reasoning_switch(thinking: dict | None) -> bool | None:
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind not in ("enabled", "adaptive", "disabled"):
        raise invalid(f'thinking.type: must be "enabled", "adaptive" or "disabled", not {kind!r}')
    return kind != "disabled"


def output_format(config: dict | None) -> dict | None:
    """output_config.format (a JSON schema) as the chat request's response_format."""
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if (
        not isinstance(fmt, dict)
        or fmt.get("type") != "json_schema"
        or not isinstance(fmt.get("schema"), dict)
    ):
        raise invalid('output_config.format: must be {"type": "json_schema", "schema": {...}}')
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def context_limit_message(exc: ContextLimit) -> str:
    """Anthropic's own wording, which clients parse (Claude Code retries with less max_tokens)."""
    if exc.max_tokens is None:
        return f"prompt is too long: {exc.prompt_tokens} tokens > {exc.context} maximum"
    return (
        f"input length and `max_tokens` exceed context limit: {exc.prompt_tokens} + {exc.max_tokens} > "
        f"{exc.context}, decrease input length or `max_tokens` and try again"
    )


def chat_tool_choice(choice: dict | None) -> Any:
    if choice is None:
        return None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid('tool_choice: type must be "auto", "any", "tool" (with a name) or "none"')


def usage_json(usage: Usage, prices=None) -> dict:
    body = {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": 0,
    }
    if prices is not None:  # tandem's extension, as on the other APIs
        body["cost"], body["cost_details"] = prices.cost(usage), prices.cost_details(usage)
    return body


def thinking(text: str) -> dict:
    """A thinking block: the model's reasoning (its signature empty: nothing here signs it)."""
    return {"type": "thinking", "thinking": text, "signature": ""}


def tool_use_id(call_id: str) -> str:
    return call_id.replace("call_", "toolu_", 1)


def tool_use(call: ToolCall) -> dict:
    return {
        "type": "tool_use",
        "id": tool_use_id(call.id),
        "name": call.name,
        "input": json.loads(call.arguments),
    }


def stop(finish: Finish) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence)."""
    if finish.stop_string:
        return "stop_sequence", finish.stop_string
    return STOP_REASONS.get(finish.reason, "end_turn"), None


class Messages(Surface):
    path = "/v1/messages"
    span_name = "messages"
    named_events = True

    def authorization(self, request) -> str | None:
        key = request.headers.get("x-api-key")
        return f"Bearer {key}" if key else request.headers.get("authorization")

    def parse(self, body: dict) -> MessagesBody:
        parsed = parse_model(MessagesBody, body, errors_as="anthropic")
        if parsed.max_tokens < 1:
            raise invalid(
                "max_tokens: Field required"
                if "max_tokens" not in body
                else "max_tokens: Input should be greater than or equal to 1",
                field="max_tokens",
            )
        return self._checked(parsed)

    @staticmethod
    def _checked(parsed: MessagesBody) -> MessagesBody:
        if parsed.service_tier not in (None, "auto", "standard_only"):
            raise invalid(
                f"service_tier: {parsed.service_tier!r} is not supported (auto, standard_only)"
            )
        return parsed

    @staticmethod
    def request(parsed: MessagesBody, session: str) -> tuple[ChatRequest, list[str]]:
        """The chat request, and the server tools left out of it."""
        options = SamplingOptions(
            max_tokens=parsed.max_tokens or None,
            temperature=parsed.temperature,
            top_p=parsed.top_p,
            top_k=parsed.top_k or 0,
            stop=tuple(parsed.stop_sequences or ()),
        )
        tools, left_out = chat_tools(parsed.tools)
        return ChatRequest(
            messages=chat_messages(parsed.system, parsed.messages),
            options=options,
            model=parsed.model,
            tools=tools,
            tool_choice=chat_tool_choice(parsed.tool_choice),
            response_format=output_format(parsed.output_config),
            session=session,
            reasoning=reasoning_switch(parsed.thinking),
            reasoning_effort=str((parsed.output_config or {}).get("effort") or ""),
            cache_salt=parsed.cache_salt or "",
        ), left_out

    def prepare(self, parsed: MessagesBody, session: str) -> requests.Prepared:
        chat, left_out = self.request(parsed, session)
        prepared = requests.chat(chat, self.model, id_prefix="msg")
        if left_out:
            prepared.warning = (
                f"server tools are not run here and were left out: {', '.join(left_out)}"
            )
        return prepared

    def routes(self) -> list[Route]:
        return [Route(self.path + "/count_tokens", self.count_tokens, methods=["POST"])]

    async def count_tokens(self, request) -> JSONResponse:
        """The prompt's tokens as a request with this body would have them (its usage's
        input_tokens when nothing is cached); max_tokens is not needed."""
        try:
            self.frontend.authenticate(self.authorization(request))
            parsed = self._checked(
                parse_model(MessagesBody, await read_body(request), errors_as="anthropic")
            )
            chat, _ = self.request(parsed, "")
            requests.check_model(self.model, chat.model)
            return JSONResponse({"input_tokens": len(requests.chat_prompt(chat, self.model))})
        except GatewayError as exc:
            return self.refused(exc)

    def message(self, prepared, content: list[dict], usage: Usage, finish: Finish | None) -> dict:
        reason, sequence = stop(finish) if finish is not None else (None, None)
        return {
            "id": prepared.request_id.replace("-", "_", 1),
            "type": "message",
            "role": "assistant",
            "model": self.model.name,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage_json(usage, self.frontend.prices),
        }

    async def unary(self, prepared, parsed: MessagesBody, events: AsyncIterator[Event]) -> dict:
        reply = await one_reply(events)
        content = (
            ([thinking(reply.reasoning)] if reply.reasoning else [])
            + ([{"type": "text", "text": reply.text}] if reply.text else [])
            + [tool_use(c) for c in reply.calls]
        )
        return self.message(prepared, content, reply.finish.usage, reply.finish)

    async def chunks(self, prepared, parsed: MessagesBody, events: AsyncIterator[Event]):
        index = -1  # of the open content block
        open_block = ""  # its type: thinking | text | tool_use | "" (none open)
        started = False

        def close() -> list[dict]:
            nonlocal open_block
            closing = (
                [
                    {
                        "type": "content_block_delta",
                        "index": index,
                        "delta": {"type": "signature_delta", "signature": ""},
                    }
                ]
                if open_block == "thinking"
                else []
            )
            closing += [{"type": "content_block_stop", "index": index}] if open_block else []
            open_block = ""
            return closing

        def open_kind(kind: str) -> list[dict]:
            nonlocal index, open_block
            if open_block == kind:
                return []
            events_ = close()
            index, open_block = index + 1, kind
            block = thinking("") if kind == "thinking" else {"type": "text", "text": ""}
            return events_ + [
                {"type": "content_block_start", "index": index, "content_block": block}
            ]

        def call_events(step: CallDelta) -> list[dict]:
            """A call's block opens when it is announced (closing the one before: blocks do not
            interleave), takes its arguments as input_json_delta, and closes when the call is
            done or abandoned (its JSON broke off; the span's text follows in a text block and
            stop_reason is end_turn), unless the next block closed it already."""
            nonlocal index, open_block, open_call
            if step.kind == START:
                opened = close()
                index, open_block, open_call = index + 1, "tool_use", step.index
                block = {
                    "type": "tool_use",
                    "id": tool_use_id(step.id),
                    "name": step.name,
                    "input": {},
                }
                opened.append(
                    {"type": "content_block_start", "index": index, "content_block": block}
                )
                return opened + input_delta(step.arguments)
            if open_block != "tool_use" or open_call != step.index:
                return []
            return input_delta(step.arguments) if step.kind == ARGUMENTS else close()

        def input_delta(text: str) -> list[dict]:
            return (
                [
                    {
                        "type": "content_block_delta",
                        "index": index,
                        "delta": {"type": "input_json_delta", "partial_json": text},
                    }
                ]
                if text
                else []
            )

        open_call = -1  # the call index of the open tool_use block
        async for event in events:
            if not started:  # the first event knows the prompt's cached tokens
                started = True
                yield {
                    "type": "message_start",
                    "message": self.message(prepared, [], event.usage, None),
                }
            if isinstance(event, Finish):
                for e in close():
                    yield e
                reason, sequence = stop(event)
                yield {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": usage_json(event.usage, self.frontend.prices),
                }
                yield {"type": "message_stop"}
                return
            if event.reasoning:
                for e in open_kind("thinking"):
                    yield e
                yield {
                    "type": "content_block_delta",
                    "index": index,
                    "delta": {"type": "thinking_delta", "thinking": event.reasoning},
                }
            if event.text:
                for e in open_kind("text"):
                    yield e
                yield {
                    "type": "content_block_delta",
                    "index": index,
                    "delta": {"type": "text_delta", "text": event.text},
                }
            for step in event.call_deltas:
                for e in call_events(step):
                    yield e

    def error_response(self, exc: GatewayError, status: int = 0) -> JSONResponse:
        code_status, body = self._error(exc)
        if isinstance(exc, ContextLimit):
            body["error"]["message"] = context_limit_message(exc)
        if status == 413:
            body["error"]["type"] = "request_too_large"
        headers = {"Retry-After": str(exc.retry_after_s)} if exc.retry_after_s else None
        return JSONResponse(body, status_code=status or code_status, headers=headers)

    def error_event(self, exc: GatewayError) -> dict:
        return self._error(exc)[1]

    @staticmethod
    def _error(exc: GatewayError) -> tuple[int, dict]:
        status, kind = ERROR_TYPES.get(exc.code, (500, "api_error"))
        return status, {"type": "error", "error": {"type": kind, "message": exc.message}}
