"""OpenAI's Responses API (`POST /v1/responses`) as a surface of the HTTP edge (http_app.py).
Its fields sort three ways (docs/apis.md lists them). Implemented, reduced to the gateway's chat
request:
- `input`: a string, or a list of items: messages (`role` user, system, developer or
  assistant; content a string or input_text/output_text parts), `function_call` and
  `function_call_output` (so a tool loop continues); `instructions` goes first as a system
  message.
- function `tools`, and `namespace` tools flattened into their function tools; `tool_choice`
  (auto, none, required, or a named function); `max_output_tokens` (without it, at most
  DEFAULT_MAX_OUTPUT_TOKENS, never past the context), `temperature`, `top_p`; `text.format`
  (text, json_object, json_schema, enforced as chat's response_format is); `reasoning.effort`
  (the template's thinking switch: none and minimal off, the others on); `prompt_cache_key`
  routes like x-session-affinity; `cache_salt` (vLLM's) salts the prompt's cache as in chat
  completions.
- `previous_response_id`: the conversation through that response, from the gateway's
  response store (response_store.py: bounded and expiring; an unknown id gets a 400).
  `store` (default true) keeps this one for follow-ups.

Accepted and ignored (they do not change the tokens): `metadata`, `client_metadata`, `include`,
`reasoning.summary`, `user`, `safety_identifier`, `parallel_tool_calls`, another provider's
encrypted `reasoning` input items (a readable one, reasoning_text as this gateway writes it, goes
back as the next assistant turn's reasoning, as stored responses keep theirs). Hosted tools tandem
cannot run (`web_search`, `file_search`, ...) are left out of the prompt, named in an
`x-tandem-warning` header, and the client goes on without them, as with providers that lack them.
Anything else gets OpenAI's 400: unknown fields, other item types, `truncation: auto`. The reply's
output is a message item (its output_text) and a function_call item per tool call; usage reports
`input_tokens_details.cached_tokens` (and cost where prices are set). Streamed, the events come in
OpenAI's order, each with its sequence_number: response.created, response.in_progress, then per item
output_item.added, content_part.added, output_text.delta ... output_text.done, content_part.done,
output_item.done (a function call: output_item.added, function_call_arguments.delta,
function_call_arguments.done, output_item.done), and response.completed (response.incomplete when
max_output_tokens cut it).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from services.gateway.api.http_app import parse_model
from services.gateway.api.openai_api import OpenAISurface
from services.gateway.api.replies import one_reply
from services.gateway.api.response_store import ResponseStore
from services.gateway.errors import GatewayError, invalid, unsupported_part
from services.gateway.output.tool_calls import ToolCall
from services.gateway.output.tool_streams import ABANDONED, ARGUMENTS, DONE, START, CallDelta
from services.gateway.prepare import requests
from services.gateway.prepare.chat import function_tool, tool_call
from services.gateway.protocol import ChatRequest, Event, Finish, SamplingOptions, Usage

DEFAULT_MAX_OUTPUT_TOKENS = 8192  # without max_output_tokens (never past the context)


class ResponsesBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = ""
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    text: dict[str, Any] | None = None
    truncation: str | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    prompt_cache_key: str | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    client_metadata: dict[str, Any] | None = None  # ignored: the client's own bookkeeping (Codex)
    cache_salt: str | None = None  # vLLM's, as in chat completions


@dataclass
class ResponsesCall:
    body: ResponsesBody
    # the conversation before this response: stored turns and this input, as chat messages
    history: list[dict]
    response_id: str = ""  # resp_..., named with its request (prepare)
    created_at: int = field(default_factory=lambda: int(time.time()))


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") not in ("input_text", "output_text", "text")
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise unsupported_part(kind, f"{where}[{i}]", "input_text, output_text")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(f"{where} must be a string or a list of input_text parts")


def _required(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and not value):
        raise invalid(f"{where}.{key} must be a non-empty string")
    return value


def _reasoning_text(item: dict) -> str:
    """A reasoning item's readable text: its reasoning_text parts, as this gateway (and open
    models' servers) write them; another provider's encrypted thoughts or summary give ""."""
    content = item.get("content")
    parts = content if isinstance(content, list) else []
    return "".join(
        p["text"]
        for p in parts
        if isinstance(p, dict)
        and p.get("type") == "reasoning_text"
        and isinstance(p.get("text"), str)
    )


def input_messages(items: str | list[dict]) -> list[dict]:
    """Responses input as chat messages: consecutive function calls join one assistant message;
    a reasoning item's text is the reasoning_content of the assistant turn it precedes (gpt-oss
    reads its analysis back while a turn's calls go on; templates read reasoning_content)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    thought = ""  # reasoning not yet given to an assistant turn
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"{where} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = {"developer": "system"}.get(item.get("role"), item.get("role"))
            if role not in ("user", "system", "assistant"):
                raise invalid(
                    f"{where}.role must be user, system, developer or assistant, not {item.get('role')!r}"
                )
            messages.append(
                {"role": role, "content": _text(item.get("content"), f"{where}.content")}
            )
        elif kind == "function_call":
            call = tool_call(
                _required(item, "call_id", where),
                _required(item, "name", where),
                _required(item, "arguments", where) or "{}",
            )
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not thought:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _required(item, "call_id", where),
                    "content": _text(output, f"{where}.output"),
                }
            )
        elif kind == "reasoning":
            thought += _reasoning_text(item)
            continue
        else:
            raise invalid(
                f"{where}: items of type {kind!r} are not supported (message, function_call, "
                "function_call_output)"
            )
        if thought and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"] = thought
        thought = ""  # reasoning before a user's or tool's message answers nothing: dropped
    if not messages:
        raise invalid("input must not be empty")
    return messages


def chat_tools(tools: list[dict] | None) -> tuple[list[dict] | None, list[str]]:
    """(function tools, namespaces flattened into theirs; the hosted tools left out)."""
    if not tools:
        return None, []
    out, left_out = [], []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise invalid(f"tools[{i}] must be an object")
        kind = tool.get("type")
        if kind == "namespace":
            inner, skipped = chat_tools(tool.get("tools") or [])
            out += inner or []
            left_out += skipped
            continue
        if (
            kind != "function"
        ):  # hosted (web_search, file_search, ...) or custom: nothing here runs them
            left_out.append(str(kind))
            continue
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise invalid(f"tools[{i}].name must be a non-empty string")
        out.append(
            function_tool(
                tool["name"],
                tool.get("description", ""),
                tool.get("parameters") or {"type": "object", "properties": {}},
            )
        )
    return out or None, left_out


def reasoning_switch(reasoning: dict | None) -> bool | None:
    effort = (reasoning or {}).get("effort")
    if effort is None:
        return None
    if effort not in ("none", "minimal", "low", "medium", "high", "xhigh"):
        raise invalid(
            f"reasoning.effort must be none, minimal, low, medium, high or xhigh, not {effort!r}"
        )
    return effort not in ("none", "minimal")


def chat_tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("name"), str)
    ):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid(
        'tool_choice must be "auto", "none", "required" or {"type": "function", "name": ...}'
    )


def response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        return {
            "type": "json_schema",
            "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt},
        }
    raise invalid('text.format.type must be "text", "json_object" or "json_schema"')


def usage_json(usage: Usage, prices) -> dict:
    body = {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.total_tokens,
    }
    if prices is not None:
        body["cost"], body["cost_details"] = prices.cost(usage), prices.cost_details(usage)
    return body


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    """The model's reasoning as an output item (its text in content, as open models' servers give it)."""
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [], "content": content}


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    content = (
        [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        if status == "completed"
        else []
    )
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": content,
    }


def call_item(item_id: str, call: ToolCall, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.name,
        "arguments": "" if status == "in_progress" else call.arguments,
        "status": status,
    }


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class Responses(OpenAISurface):
    path = "/v1/responses"
    span_name = "responses"
    named_events = True
    done = None

    def __init__(self, frontend, store: ResponseStore):
        super().__init__(frontend)
        self.store = store

    def parse(self, body: dict) -> ResponsesCall:
        parsed = parse_model(ResponsesBody, body)
        if parsed.truncation not in (None, "disabled"):
            raise invalid(
                'truncation must be "disabled": a conversation over the context gets a 400',
                field="truncation",
            )
        if parsed.service_tier not in (None, "auto", "default"):
            raise invalid(f"service_tier={parsed.service_tier!r} is not supported (auto, default)")
        history = []
        if parsed.previous_response_id:
            stored = self.store.get(parsed.previous_response_id)
            if stored is None:
                raise invalid(
                    f"previous response with id {parsed.previous_response_id!r} not found (unknown, expired, "
                    f"or evicted: this server keeps {self.store.max_responses} for "
                    f"{self.store.ttl_s:.0f} s)"
                )
            history = list(stored)
        return ResponsesCall(parsed, history + input_messages(parsed.input))

    def stream(self, call: ResponsesCall) -> bool:
        return call.body.stream

    def prepare(self, call: ResponsesCall, session: str) -> requests.Prepared:
        body = call.body
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        options = SamplingOptions(
            max_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p
        )
        tools, left_out = chat_tools(body.tools)
        request = ChatRequest(
            messages=system + call.history,
            options=options,
            model=body.model,
            tools=tools,
            tool_choice=chat_tool_choice(body.tool_choice),
            response_format=response_format(body.text),
            session=session or body.prompt_cache_key or "",
            reasoning=reasoning_switch(body.reasoning),
            reasoning_effort=(body.reasoning or {}).get("effort") or "",
            cache_salt=body.cache_salt or "",
        )
        prepared = requests.chat(
            request, self.model, id_prefix="resp", default_max_tokens=DEFAULT_MAX_OUTPUT_TOKENS
        )
        call.response_id = prepared.request_id.replace("-", "_", 1)
        if left_out:
            prepared.warning = (
                f"hosted tools are not run here and were left out: {', '.join(left_out)}"
            )
        return prepared

    def response(
        self, call: ResponsesCall, status: str, output: list[dict], usage: Usage | None = None
    ) -> dict:
        body = call.body
        incomplete = status == "incomplete"
        return {
            "id": call.response_id,
            "object": "response",
            "created_at": call.created_at,
            "status": status,
            "model": self.model.name,
            "output": output,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "parallel_tool_calls": body.parallel_tool_calls
            if body.parallel_tool_calls is not None
            else True,
            "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [],
            "previous_response_id": body.previous_response_id,
            "store": body.store is not False,
            "text": body.text or {"format": {"type": "text"}},
            "truncation": "disabled",
            "metadata": body.metadata or {},
            "user": body.user,
            "usage": usage_json(usage, self.frontend.prices) if usage is not None else None,
        }

    def _finished(
        self, call: ResponsesCall, reasoning: str, text: str, calls: list[ToolCall], finish: Finish
    ) -> str:
        """Stores the conversation through this response (unless `store: false`); its status."""
        if call.body.store is not False:
            reply = {"role": "assistant", "content": text}
            if reasoning:
                reply["reasoning_content"] = reasoning
            if calls:
                reply["tool_calls"] = [tool_call(c.id, c.name, c.arguments) for c in calls]
            self.store.put(call.response_id, call.history + [reply])
        return "incomplete" if finish.reason == "length" else "completed"

    async def unary(self, prepared, call: ResponsesCall, events: AsyncIterator[Event]) -> dict:
        reply = await one_reply(events)
        text, calls = reply.text, reply.calls
        output = (
            ([reasoning_item(_item_id("rs"), reply.reasoning)] if reply.reasoning else [])
            + ([message_item(_item_id("msg"), text)] if text or not calls else [])
            + [call_item(_item_id("fc"), c) for c in calls]
        )
        status = self._finished(call, reply.reasoning, text, calls, reply.finish)
        return self.response(call, status, output, reply.finish.usage)

    async def chunks(self, prepared, call: ResponsesCall, events: AsyncIterator[Event]):
        stream = _EventStream()
        yield stream.event("response.created", response=self.response(call, "in_progress", []))
        yield stream.event("response.in_progress", response=self.response(call, "in_progress", []))
        output: list[dict] = []
        message: dict | None = None  # the open message item
        thought: dict | None = None  # the open reasoning item
        thoughts: list[str] = []
        texts: list[str] = []
        calls: list[ToolCall] = []
        async for event in events:
            if isinstance(event, Finish):
                if thought is not None:
                    for e in stream.close_reasoning(thought, output):
                        yield e
                if (
                    message is None and not calls
                ):  # a reply without text or calls still has its (empty) message
                    message, opened = stream.open_message()
                    for e in opened:
                        yield e
                if message is not None:
                    for e in stream.close_message(message, output):
                        yield e
                status = self._finished(call, "".join(thoughts), "".join(texts), calls, event)
                yield stream.event(
                    f"response.{status}", response=self.response(call, status, output, event.usage)
                )
                return
            if event.reasoning:
                if thought is None:
                    thought, opened = stream.open_reasoning()
                    for e in opened:
                        yield e
                thought["text"].append(event.reasoning)
                thoughts.append(event.reasoning)
                yield stream.event(
                    "response.reasoning_text.delta",
                    item_id=thought["id"],
                    output_index=thought["index"],
                    content_index=0,
                    delta=event.reasoning,
                )
            if thought is not None and (
                event.text or event.call_deltas
            ):  # a delta's reasoning precedes its text
                for e in stream.close_reasoning(thought, output):
                    yield e
                thought = None
            if event.text:
                texts.append(event.text)
                if message is None:
                    message, opened = stream.open_message()
                    for e in opened:
                        yield e
                message["text"].append(event.text)
                yield stream.event(
                    "response.output_text.delta",
                    item_id=message["id"],
                    output_index=message["index"],
                    content_index=0,
                    delta=event.text,
                    logprobs=[],
                )
            for step in event.call_deltas:
                if message is not None:
                    for e in stream.close_message(message, output):
                        yield e
                    message = None
                if step.kind == DONE:
                    calls.append(step.call)
                for e in stream.function_call(step, output):
                    yield e

    def error_event(self, exc: GatewayError) -> dict:
        body = super().error_event(exc)["error"]
        return {"type": "error", "code": body["code"], "message": body["message"], "param": None}


class _EventStream:
    """The Responses stream's events, numbered, and its items' open and close sequences."""

    def __init__(self):
        self.sequence = 0
        self.num_items = 0  # output items opened: the next one's output_index
        self.calls: dict[int, dict] = {}  # open function calls by call index

    def event(self, kind: str, **fields) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def _index(self) -> int:
        self.num_items += 1
        return self.num_items - 1

    def open_message(self) -> tuple[dict, list[dict]]:
        """A new message item: its state, and the events that open it."""
        item_id, index = _item_id("msg"), self._index()
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return {"id": item_id, "index": index, "text": []}, [
            self.event(
                "response.output_item.added",
                output_index=index,
                item=message_item(item_id, "", "in_progress"),
            ),
            self.event(
                "response.content_part.added",
                item_id=item_id,
                output_index=index,
                content_index=0,
                part=part,
            ),
        ]

    def open_reasoning(self) -> tuple[dict, list[dict]]:
        item_id, index = _item_id("rs"), self._index()
        return {"id": item_id, "index": index, "text": []}, [
            self.event(
                "response.output_item.added",
                output_index=index,
                item=reasoning_item(item_id, "", "in_progress"),
            )
        ]

    def close_reasoning(self, thought: dict, output: list[dict]) -> list[dict]:
        text = "".join(thought["text"])
        item = reasoning_item(thought["id"], text)
        output.append(item)
        return [
            self.event(
                "response.reasoning_text.done",
                item_id=thought["id"],
                output_index=thought["index"],
                content_index=0,
                text=text,
            ),
            self.event("response.output_item.done", output_index=thought["index"], item=item),
        ]

    def close_message(self, message: dict, output: list[dict]) -> list[dict]:
        text = "".join(message["text"])
        item = message_item(message["id"], text)
        output.append(item)
        where = dict(item_id=message["id"], output_index=message["index"], content_index=0)
        return [
            self.event("response.output_text.done", **where, text=text, logprobs=[]),
            self.event("response.content_part.done", **where, part=item["content"][0]),
            self.event("response.output_item.done", output_index=message["index"], item=item),
        ]

    def function_call(self, step: CallDelta, output: list[dict]) -> list[dict]:
        """A call's step as events: announced, its item opens; its arguments stream as deltas;
        done, the item completes and joins the output. Abandoned (its arguments turned out not
        to be JSON: output/tool_streams.py), the item ends "incomplete" and stays out of the output,
        which then matches the unary reply; no `function_call_arguments.done` is sent for it."""
        if step.kind == START:
            state = self.calls[step.index] = {
                "id": _item_id("fc"),
                "index": self._index(),
                "call_id": step.id,
                "name": step.name,
                "arguments": [],
            }
            events = [
                self.event(
                    "response.output_item.added",
                    output_index=state["index"],
                    item=call_item(state["id"], ToolCall(step.name, "", step.id), "in_progress"),
                )
            ]
            return events + self._arguments(state, step.arguments)
        state = self.calls[step.index]
        if step.kind == ARGUMENTS:
            return self._arguments(state, step.arguments)
        del self.calls[step.index]
        if step.kind == ABANDONED:
            call = ToolCall(state["name"], "".join(state["arguments"]), state["call_id"])
            return [
                self.event(
                    "response.output_item.done",
                    output_index=state["index"],
                    item=call_item(state["id"], call, "incomplete"),
                )
            ]
        item = call_item(state["id"], step.call)
        output.append(item)
        return [
            self.event(
                "response.function_call_arguments.done",
                item_id=state["id"],
                output_index=state["index"],
                arguments=step.call.arguments,
                name=step.call.name,
            ),
            self.event("response.output_item.done", output_index=state["index"], item=item),
        ]

    def _arguments(self, state: dict, text: str) -> list[dict]:
        if not text:
            return []
        state["arguments"].append(text)
        return [
            self.event(
                "response.function_call_arguments.delta",
                item_id=state["id"],
                output_index=state["index"],
                delta=text,
            )
        ]
