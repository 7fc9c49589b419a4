"""Structured outputs: the grammar a chat request's reply must follow, for the engine's
llguidance matcher (engine/grammar.py).

- `response_format: {"type": "json_schema", "json_schema": {"schema": ...}}`: JSON that
  follows the schema; `{"type": "json_object"}`: any JSON object. Written compact, as
  `json.dumps` writes it (", " and ": ", no other whitespace): a model free to add
  whitespace may never stop adding it. A format whose answer follows markup of its own
  (harmony's `<|channel|>final<|message|>`, `CallFormat.reply_head`) gets that markup first.
- `tool_choice: "required"`, or a named function: the reply is exactly one tool call in the
  model's own markup where its format can force one (output/tool_formats.py: kimi_k2, deepseek_v3,
  deepseek_v31, llama3_json, llama4_json), else in hermes' (`<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`), its name one of the offered functions (or the named one) and its
  arguments following that function's `parameters` schema; output/tool_calls.py parses it back in
  the same markup. A tag that is one token of the vocabulary is matched as that token.

A schema llguidance cannot compile is refused with a 400 naming the problem.
"""

from __future__ import annotations

import json
from typing import Any

from services.gateway.errors import invalid
from services.gateway.output.tool_calls import CallFormat
from services.gateway.output.tool_formats import HERMES

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _checked(grammar: str) -> str:
    from llguidance import LLMatcher

    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise invalid(f"the output schema cannot be enforced: {error}")
    return grammar


def _json_grammar(schema: Any, head: str = "") -> str:
    """`head`: lark for the markup before the JSON (none: the JSON alone)."""
    from llguidance import LLMatcher

    if not isinstance(schema, dict):
        raise invalid("response_format.json_schema.schema must be a JSON object")
    try:
        if head:
            reply = json.dumps({**schema, "x-guidance": JSON_OPTIONS})
            return _checked(
                LLMatcher.grammar_from_lark(f"start: {head} reply\nreply: %json {reply}\n")
            )
        return _checked(LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))
    except ValueError as exc:
        raise invalid(f"the output schema cannot be enforced: {exc}") from None


def response_format_grammar(response_format: dict | None, head: str = "") -> str:
    """The grammar for `response_format` ("" for text, or none), after `head` (lark)."""
    if response_format is None or response_format.get("type") == "text":
        return ""
    kind = response_format.get("type")
    if kind == "json_object":
        return _json_grammar({"type": "object"}, head)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise invalid(
                'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}'
            )
        return _json_grammar(spec["schema"], head)
    raise invalid(
        f"response_format type {kind!r} is not supported; use text, json_object or json_schema"
    )


def _tag(tokenizer, text: str) -> str:
    """A tag in lark: its token (`<[id]>`) when the vocabulary has it as one, else the text."""
    ids = tokenizer.encode(text)
    return (
        f"<[{ids[0]}]>"
        if len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=False) == text
        else json.dumps(text)
    )


def chosen_functions(tools: list[dict], tool_choice: Any) -> list[dict]:
    """The functions `tool_choice` forces one of ("required" or a named one); [] when it forces none."""
    if tool_choice in (None, "auto", "none"):
        return []
    functions = [
        t.get("function", {}) for t in tools or [] if t.get("type", "function") == "function"
    ]
    if tool_choice == "required":
        chosen = functions
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        chosen = [f for f in functions if f.get("name") == name]
        if not chosen:
            raise invalid(f"tool_choice names function {name!r}, which is not among the tools")
    else:
        raise invalid(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
        )
    if not chosen:
        raise invalid('tool_choice "required" needs at least one function in tools')
    return chosen


def tool_call_grammar(
    tools: list[dict], tool_choice: Any, tokenizer, fmt: CallFormat = HERMES, call_index: int = 0
) -> tuple[str, CallFormat]:
    """The grammar for `tool_choice` "required" or a named function ("" otherwise), and the
    markup it forces (`fmt`'s where the format can force a call, else hermes'). `call_index`:
    the calls already in the conversation (Kimi numbers its call ids across it)."""
    chosen = chosen_functions(tools, tool_choice)
    if not chosen:
        return "", fmt
    if fmt.forced is None:
        fmt = HERMES
    tag = lambda text: _tag(tokenizer, text)  # noqa: E731
    arguments = [
        {**(f.get("parameters") or {"type": "object"}), "x-guidance": JSON_OPTIONS} for f in chosen
    ]
    lark = fmt.forced([f["name"] for f in chosen], arguments, tag, call_index)
    from llguidance import LLMatcher

    return _checked(LLMatcher.grammar_from_lark(lark)), fmt


def chat_grammar(
    response_format: dict | None,
    tools: list[dict] | None,
    tool_choice: Any,
    tokenizer,
    fmt: CallFormat = HERMES,
    call_index: int = 0,
) -> tuple[str, CallFormat]:
    """The reply's grammar ("" for none) and the markup tool calls come in (`fmt`, or hermes'
    for a call forced in it)."""
    head = " ".join(_tag(tokenizer, m) for m in fmt.reply_head)
    formats = response_format_grammar(response_format, head)
    calls, fmt = tool_call_grammar(tools or [], tool_choice, tokenizer, fmt, call_index)
    if formats and calls:
        raise invalid("response_format and a forced tool_choice cannot both apply to one reply")
    return formats or calls, fmt
