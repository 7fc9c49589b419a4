"""Chat requests to prompt text: message checks, content parts, tools, the model's template."""

from __future__ import annotations

import json

from engine.tokenizer import Tokenizer
from services.gateway.errors import invalid, unsupported_part
from services.gateway.output.tool_calls import CallFormat

ROLES = ("system", "user", "assistant", "tool")


def message_text(content, index: int) -> str:
    """A message's content: a string, or a list of text parts (OpenAI's array form)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise unsupported_part(kind, f"messages[{index}].content[{j}]", "text")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid(f"messages[{index}].content must be a string or a list of text parts")


def normalize_messages(messages: list[dict]) -> list[dict]:
    """Plain dicts the chat template reads: role, content as text, tool calls with parsed arguments."""
    if not messages:
        raise invalid("messages must not be empty")
    out = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in ROLES:
            raise invalid(f"messages[{i}].role must be one of {', '.join(ROLES)}, not {role!r}")
        entry = {"role": role, "content": message_text(message.get("content"), i)}
        thought = message.get("reasoning_content") or message.get("reasoning")
        if (
            role == "assistant" and isinstance(thought, str) and thought
        ):  # templates read reasoning_content
            entry["reasoning_content"] = thought
        if message.get("tool_calls"):
            entry["tool_calls"] = [_tool_call(call, i) for call in message["tool_calls"]]
        if message.get("tool_call_id"):
            entry["tool_call_id"] = message["tool_call_id"]
        if message.get("name"):
            entry["name"] = message["name"]
        if message.get("is_error"):  # a tool result that reports a failure (Anthropic's is_error)
            entry["is_error"] = True
        out.append(entry)
    return out


def _tool_call(call: dict, index: int) -> dict:
    function = call.get("function") or {}
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except ValueError:
        raise invalid(f"messages[{index}].tool_calls: arguments must be a JSON object") from None
    return {
        "id": call.get("id", ""),
        "type": "function",
        "function": {"name": function.get("name", ""), "arguments": arguments},
    }


def function_tool(name: str, description: str, parameters: dict) -> dict:
    """A function tool in chat's shape and key order (name, description, parameters): a
    template renders the tools as JSON, so the other APIs' tools render as chat's do."""
    function = {"name": name}
    if description:
        function["description"] = description
    function["parameters"] = parameters
    return {"type": "function", "function": function}


def tool_call(call_id: str, name: str, arguments: str) -> dict:
    """An assistant message's tool call in chat's shape (`arguments`: a JSON object's text)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# Variables the gateway itself gives the template: a request's chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_VARIABLES = (
    "messages",
    "tools",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
)


def _arguments_as_text(messages: list[dict]) -> list[dict]:
    return [
        {
            **m,
            "tool_calls": [
                {
                    **c,
                    "function": {
                        **c["function"],
                        "arguments": json.dumps(c["function"]["arguments"], ensure_ascii=False),
                    },
                }
                for c in m["tool_calls"]
            ],
        }
        if m.get("tool_calls")
        else m
        for m in messages
    ]


def render_prompt(
    tokenizer: Tokenizer,
    messages: list[dict],
    tools: list[dict] | None,
    reasoning: bool | None = None,
    template_kwargs: dict | None = None,
    tool_format: CallFormat | None = None,
) -> str:
    """`reasoning`: the model's thinking switch, under the names templates read (Qwen3's
    enable_thinking, DeepSeek-V3.1's thinking); None leaves the template's default.
    `template_kwargs`: a request's chat_template_kwargs, passed on (they win over the switch).
    History tool calls reach the template with their arguments as an object, as most templates
    (and transformers) expect; a template that joins them as text (DeepSeek-V3.1's) gets text.
    `tool_format`: the model's markup, which may prepare the conversation as its family does (Kimi's)."""
    normalized = normalize_messages(messages)
    if tool_format is not None and tool_format.conversation is not None:
        normalized, tools = tool_format.conversation(normalized, tools)
    switch = {} if reasoning is None else {"enable_thinking": reasoning, "thinking": reasoning}
    extra = dict(template_kwargs or {})
    if reserved := [k for k in extra if k in RESERVED_TEMPLATE_VARIABLES]:
        raise invalid(
            f"chat_template_kwargs: {', '.join(reserved)} cannot be set (the server gives them)"
        )
    try:
        try:
            return tokenizer.apply_chat_template(
                normalized, tools=tools or None, **{**switch, **extra}
            )
        except (
            TypeError
        ):  # e.g. `'...' + arguments + '...'`: the template wants the arguments' text
            return tokenizer.apply_chat_template(
                _arguments_as_text(normalized), tools=tools or None, **{**switch, **extra}
            )
    except (
        Exception
    ) as exc:  # templates raise on input they do not accept (jinja's raise_exception)
        raise invalid(f"the chat template rejected the messages: {exc}") from exc
