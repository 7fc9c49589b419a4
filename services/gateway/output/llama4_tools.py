"""Llama 4's tool calls, under vLLM's parser names, read as they stream (tool_calls.py).

- llama4_json: `{"name": NAME, "parameters": {...}}` as the whole output (`"arguments"` read
  too), optionally with `"type": "function"` first (how llama-models writes a past call), several
  one after another (nothing, `;` or `,` between), optionally inside `<|python_start|>` ...
  `<|python_end|>`. Arguments stream as JSON text, as llama3_json's do.
- llama4_pythonic: `[NAME(KEY=VALUE, ...), ...]` as the whole output, optionally inside
  `<|python_start|>` ... `<|python_end|>`; a NAME may be dotted; VALUEs are Python literals
  (output/pythonic.py) and reach the client as JSON: a call's arguments are
  `json.dumps({KEY: VALUE, ...}, ensure_ascii=False)`. Positional arguments and anything but a
  literal make the output text, as llama-models' own check (`is_valid_python_list`) and vLLM's
  parser refuse them.

`PythonicReader` streams pythonic calls: a call is announced once `NAME(` is written, its
arguments go out as JSON as each `KEY=` and each VALUE is complete, and a plain string
value's characters go out as they are written (up to an escape that may still grow). At the
span's close the whole-body parse decides, as SpanReader's does (tool_streams.py): the calls
must be the ones announced, each one's arguments continuing what was sent, else the span is
abandoned and comes back as text.

A reply that starts with `[` (or `{`) is held until it ends or is found to be calls: a reply
that merely starts so comes back whole, as text, when it ends.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import uuid
import warnings

from services.gateway.output.pythonic import ValueScan, dotted_name, literal, parse_expression
from services.gateway.output.tool_calls import ToolCall, call_from
from services.gateway.output.tool_streams import (
    ARGUMENTS,
    DONE,
    LOOKAHEAD,
    START,
    CallDelta,
    CallShape,
    CallStream,
)

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
MARKERS = (PYTHON_START, PYTHON_END)


def _body(text: str) -> str:
    """The calls of a span: without `<|python_end|>` and the whitespace around them."""
    return text.replace(PYTHON_END, "").strip()


def _all_or_none(calls):
    return calls if calls and all(c is not None for c in calls) else None


def llama4_json(body: str) -> list[ToolCall] | None:
    body = _body(body)
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            obj, at = decoder.raw_decode(body, at)
        except ValueError:
            return None
        calls.append(
            call_from(obj.get("name"), obj.get("parameters", obj.get("arguments", {})))
            if isinstance(obj, dict) and obj.get("type", "function") == "function"
            else None
        )
        rest = body[at:].lstrip()
        at = len(body) - len(rest.removeprefix(";").removeprefix(",").lstrip())
    return _all_or_none(calls)


_TYPE = r'(?:"type"\s*:\s*"function"\s*,\s*)?'
_NAME = r"\{\s*" + _TYPE + r'"name"\s*:\s*"(?P<name>(?:[^"\\\x00-\x1f]|\\.)*)"'
JSON_STREAM = CallStream(
    (
        CallShape(
            re.compile(r"\s*" + _NAME),
            re.compile(r"\s*\}\s*[;,]?\s*" + _NAME),
            re.compile(r'\s*,\s*"(?:parameters|arguments)"\s*:\s*(?=\{)'),
        ),
    )
)


def llama4_pythonic(body: str) -> list[ToolCall] | None:
    tree = parse_expression(_body(body))
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
            return None
        try:
            arguments = {k.arg: literal(k.value) for k in node.keywords}
        except ValueError:
            return None
        calls.append(call_from(dotted_name(node.func), arguments))
    return _all_or_none(calls)


_OPEN = re.compile(r"\s*\[")
_HEAD = re.compile(r"\s*(?P<name>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)\s*\(")
_KEY = re.compile(r"\s*(?P<key>[A-Za-z_]\w*)\s*=(?!=)\s*")
_CALL_END = re.compile(r"\s*\)")
_AFTER_CALL = re.compile(r"\s*(?P<sep>[,\]])")


@dataclasses.dataclass
class _Call:
    index: int
    id: str
    name: str
    sent: str = ""  # the arguments' JSON sent so far
    num_keys: int = 0


class PythonicReader:
    """One span's pythonic calls as its body streams in (`extend`), then checked against the
    whole-body parse (`close`): SpanReader's interface (tool_streams.py)."""

    def __init__(self, first_index: int):
        self.first_index = first_index
        self.body = ""
        self.at = 0
        self.calls: list[_Call] = []
        self.value: ValueScan | None = None  # the value being read
        self.value_sent = ""  # its JSON sent so far
        self.decoded = 0  # where a plain string's sent characters end in the body
        self.phase = "open"  # open | name | key | value | after_call | end | stopped | failed

    def extend(self, text: str) -> list[CallDelta]:
        self.body += text
        out: list[CallDelta] = []
        steps = {
            "open": self._open,
            "name": self._name,
            "key": self._key,
            "value": self._value,
            "after_call": self._after_call,
        }
        while self.phase in steps and steps[self.phase](out):
            pass
        return out

    def _match(self, pattern: re.Pattern) -> re.Match | None:
        window = self.body[self.at : self.at + LOOKAHEAD]
        match = pattern.match(window)
        if match is None and len(window) == LOOKAHEAD:
            self.phase = "stopped"
        return match

    def _send(self, out: list[CallDelta], text: str) -> None:
        call = self.calls[-1]
        call.sent += text
        out.append(CallDelta(ARGUMENTS, call.index, arguments=text))

    def _open(self, out) -> bool:
        match = self._match(_OPEN)
        if match:
            self.at += match.end()
            self.phase = "name"
        return bool(match)

    def _name(self, out) -> bool:
        match = self._match(_HEAD)
        if match is None:
            return False
        call = _Call(
            self.first_index + len(self.calls), f"call_{uuid.uuid4().hex[:24]}", match["name"]
        )
        self.calls.append(call)
        out.append(CallDelta(START, call.index, call.id, call.name))
        self._send(out, "{")
        self.at += match.end()
        self.phase = "key"
        return True

    def _key(self, out) -> bool:
        call = self.calls[-1]
        end = self._match(_CALL_END)
        if end is not None:
            self._send(out, "}")
            self.at += end.end()
            self.phase = "after_call"
            return True
        match = self._match(_KEY)
        if match is None:
            return False
        self._send(out, (", " if call.num_keys else "") + json.dumps(match["key"]) + ": ")
        call.num_keys += 1
        self.at += match.end()
        self.value, self.value_sent = None, ""
        self.phase = "value"
        return True

    def _value(self, out) -> bool:
        if self.value is None:
            start = len(self.body) - len(self.body[self.at :].lstrip())
            if start == len(self.body):
                return False
            self.value, self.decoded = ValueScan(self.body, start), start + 1
        scan = self.value
        end = scan.end(self.body)
        if end is None:
            if scan.plain and scan.close and scan.settled > self.decoded:
                self._string_piece(out, scan)
            return False
        node = parse_expression(self.body[scan.start : end].strip()) if end >= 0 else None
        try:
            value = json.dumps(literal(node), ensure_ascii=False) if node else None
        except ValueError:
            value = None
        if value is None or not value.startswith(self.value_sent):
            self.phase = "failed"
            return False
        self._send(out, value[len(self.value_sent) :])
        self.at, self.value = end + 1, None
        if self.body[end] == ")":
            self._send(out, "}")
            self.phase = "after_call"
        else:
            self.phase = "key"
        return True

    def _string_piece(self, out, scan: ValueScan) -> None:
        """A plain string's newly settled characters, as JSON (its escaping is per character,
        so the pieces join to the start of the whole string's JSON)."""
        quote = self.body[scan.start]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                piece = ast.literal_eval(quote + self.body[self.decoded : scan.settled] + quote)
            except (SyntaxError, ValueError):  # a raw newline: the whole value decides
                scan.plain = False
                return
        text = ("" if self.value_sent else '"') + json.dumps(piece, ensure_ascii=False)[1:-1]
        self.decoded = scan.settled
        self.value_sent += text
        self._send(out, text)

    def _after_call(self, out) -> bool:
        match = self._match(_AFTER_CALL)
        if match is None:
            return False
        self.at += match.end()
        self.phase = "name" if match["sep"] == "," else "end"
        return self.phase == "name"

    def announced(self) -> list[int]:
        return [c.index for c in self.calls]

    def close(self, parsed: list[ToolCall] | None) -> list[CallDelta] | None:
        """The span's remaining deltas, given the whole-body parse; None: abandon it."""
        if self.phase == "failed" or not parsed or len(self.calls) > len(parsed):
            return None
        out: list[CallDelta] = []
        for i, whole in enumerate(parsed):
            if i >= len(self.calls):
                index = self.first_index + i
                out += [
                    CallDelta(START, index, whole.id, whole.name, whole.arguments),
                    CallDelta(DONE, index, call=whole),
                ]
                continue
            call = self.calls[i]
            if call.name != whole.name or not whole.arguments.startswith(call.sent):
                return None
            if whole.arguments[len(call.sent) :]:
                out.append(
                    CallDelta(ARGUMENTS, call.index, arguments=whole.arguments[len(call.sent) :])
                )
            out.append(CallDelta(DONE, call.index, call=dataclasses.replace(whole, id=call.id)))
        return out
