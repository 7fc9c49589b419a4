"""Tool calls announced and their arguments streamed while a span is still open (tool_calls.py
finds the spans), for the formats whose arguments are JSON text in the markup.

A format's `CallStream` gives the shapes of its calls as three anchored patterns: `first`
(from the span's start to the end of the first call's name), `next` (from the end of one
call's arguments to the end of the next call's name) and `arguments` (from the end of a name
to the `{` that opens its arguments). A `SpanReader` reads the span's body as it grows:

1. A call is announced (`CallDelta` "start": index, id, name) as soon as its name matches.
2. From its `{` the arguments go through a JsonPrefix, and the decided part goes out as
   "arguments" deltas; the raw text from `{` to its matching `}` is the call's arguments.
3. When the span closes, `close` checks the reading against the format's whole-span parse
   (`CallFormat.parse`): the same calls, names and argument values. Each call then finishes
   ("arguments" with any rest, then "done"); calls the reader had not reached (a shape it does
   not know, e.g. the arguments before the name, or given as a JSON string) are announced with
   their whole arguments at that point.

A span whose arguments turn out not to be JSON, whose whole-span parse fails, or that the
parse reads differently from the stream, is *abandoned*: `close` returns None and the parser
sends "abandoned" for each call of the span it announced, then the whole span as text. So a
client has seen at most a valid JSON prefix of such a call, never a finished one, and the
turn ends with finish_reason "stop" unless another call finished.

The patterns match the same way on any longer text once they match (every repetition is
followed by a character it cannot take), so where the text is cut never changes a reading.
A name is looked for in at most `LOOKAHEAD` characters: past that the reader stops and the
span's calls come at its close.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from services.gateway.output.json_prefix import JsonPrefix

LOOKAHEAD = 512

START, ARGUMENTS, DONE, ABANDONED = "start", "arguments", "done", "abandoned"


@dataclass(frozen=True)
class CallDelta:
    """A step of the call at `index` (the turn's calls counted from 0, abandoned ones too)."""

    kind: str  # start | arguments | done | abandoned
    index: int
    id: str = ""  # start: the call's id
    name: str = ""  # start: the function's name
    arguments: str = ""  # start, arguments: more of the arguments text
    call: object = None  # done: the ToolCall


@dataclass(frozen=True)
class CallShape:
    first: re.Pattern
    next: re.Pattern | None  # None: one call a span
    arguments: re.Pattern


@dataclass(frozen=True)
class CallStream:
    # tried in order on the first call, the one that matches staying for the span; they must
    # differ in their first character (mistral's JSON list and NAME[ARGS]), or a cut could pick another
    shapes: tuple[CallShape, ...]
    new_id: Callable[[], str] = lambda: f"call_{uuid.uuid4().hex[:24]}"


def name_of(match: re.Match) -> tuple[str, str | None]:
    """(name, id if the markup carries it) of a matched head: a JSON string's content
    (`name`), bare text (`bare`), or Kimi's `functions.NAME:IDX` (`id`)."""
    groups = match.groupdict()
    if groups.get("name") is not None:
        return json.loads(f'"{groups["name"]}"'), None
    if groups.get("bare") is not None:
        return groups["bare"].strip(), None
    call_id = groups["id"]
    return call_id.removeprefix("functions.").rsplit(":", 1)[0], call_id


class _Call:
    def __init__(self, index: int, call_id: str, name: str):
        self.index, self.id, self.name = index, call_id, name
        self.json: JsonPrefix | None = None  # set once the arguments' `{` is found
        self.start = 0  # where the arguments start in the body
        self.sent = 0  # characters of them sent
        self.raw: str | None = None  # the whole arguments, once they end


class SpanReader:
    """One span's calls as its body streams in (`extend`), then checked and finished (`close`)."""

    def __init__(self, stream: CallStream, first_index: int):
        self.stream, self.first_index = stream, first_index
        self.body = ""
        self.at = 0  # where the next pattern is tried
        self.shape: CallShape | None = None
        self.calls: list[_Call] = []
        self.phase = "name"  # name | arguments_start | arguments | stopped | failed

    def extend(self, text: str) -> list[CallDelta]:
        self.body += text
        out: list[CallDelta] = []
        steps = {
            "name": self._name,
            "arguments_start": self._arguments_start,
            "arguments": self._arguments,
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

    def _name(self, out: list[CallDelta]) -> bool:
        shapes = (self.shape,) if self.shape else self.stream.shapes
        for shape in shapes:
            pattern = shape.first if not self.calls else shape.next
            match = self._match(pattern) if pattern is not None else None
            if match is not None:
                break
        else:
            if self.shape is not None and self.shape.next is None:
                self.phase = "stopped"
            return False
        self.shape = shape
        name, call_id = name_of(match)
        call = _Call(self.first_index + len(self.calls), call_id or self.stream.new_id(), name)
        self.calls.append(call)
        out.append(CallDelta(START, call.index, call.id, call.name))
        self.at += match.end()
        self.phase = "arguments_start"
        return True

    def _arguments_start(self, out: list[CallDelta]) -> bool:
        match = self._match(self.shape.arguments)
        if match is None:
            return False
        self.at += match.end()
        call = self.calls[-1]
        call.json, call.start = JsonPrefix(), self.at
        self.phase = "arguments"
        return True

    def _arguments(self, out: list[CallDelta]) -> bool:
        call = self.calls[-1]
        used = call.json.feed(self.body[self.at :])
        self.at += used
        decided = self.body[call.start + call.sent : call.start + call.json.decided]
        if decided:  # valid even where what follows broke the JSON
            call.sent += len(decided)
            out.append(CallDelta(ARGUMENTS, call.index, arguments=decided))
        if call.json.failed:
            self.phase = "failed"
            return False
        if call.json.end is None:
            return False
        call.raw = self.body[call.start : call.start + call.json.end]
        self.phase = "name"
        return True

    def announced(self) -> list[int]:
        return [c.index for c in self.calls]

    def close(self, parsed: list | None) -> list[CallDelta] | None:
        """The span's remaining deltas, given the format's parse of its whole body; None: abandon it."""
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
            if call.name != whole.name:
                return None
            if call.raw is not None:
                if json.loads(call.raw) != json.loads(whole.arguments):
                    return None
                arguments = call.raw
            elif call.json is not None:  # its arguments began and never ended
                return None
            else:
                arguments = whole.arguments
            if arguments[call.sent :]:
                out.append(CallDelta(ARGUMENTS, call.index, arguments=arguments[call.sent :]))
            out.append(
                CallDelta(
                    DONE,
                    call.index,
                    call=dataclasses.replace(whole, arguments=arguments, id=call.id),
                )
            )
        return out


def call_deltas_json(deltas) -> list[dict]:
    """A chunk's `tool_calls`: a call's announcement (index, id, name, its first arguments),
    then its arguments in pieces by index, as OpenAI streams them; one entry a call. A call
    that finishes or is abandoned sends nothing more (the finish_reason tells which)."""
    out: list[dict] = []
    for d in deltas:
        if d.kind == START:
            out.append(
                {
                    "index": d.index,
                    "id": d.id,
                    "type": "function",
                    "function": {"name": d.name, "arguments": d.arguments},
                }
            )
        elif d.kind == ARGUMENTS:
            if out and out[-1]["index"] == d.index:
                out[-1]["function"]["arguments"] += d.arguments
            else:
                out.append({"index": d.index, "function": {"arguments": d.arguments}})
    return out
