"""Tool calls out of model text, as it streams, in the markup of the model's family
(tool_formats.py: one CallFormat a family, with vLLM's parser names).

Text outside a call span is content. A span opens at the format's start marker (or, for
formats that write bare JSON, at the start of the output) and closes at its end marker, or
at the end of the output where the format has none. While it is open its calls are
announced and their arguments stream as they are written (tool_streams.py); when it closes
its body is parsed whole, and the calls finish. `ToolCallParser.read` returns, in order, the
content that is safe to show now and the calls' steps: text that might be the start of a
marker is held back until it is not, and a span whose body does not parse, or that never
closes, is shown as the text it was rather than lost (its announced calls abandoned).

A call's arguments are the model's own JSON text, exactly as it wrote them between the `{`
and its `}`, so the arguments deltas a client joins equal the finished call's arguments.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from services.gateway.output.tool_streams import (
    ABANDONED,
    DONE,
    START,
    CallDelta,
    CallStream,
    SpanReader,
)

Part = str | CallDelta  # what the parser hands on: content, or a step of a call
NO_STREAM = CallStream(())  # a format whose calls all come when their span closes

START_TAG = "<tool_call>"  # the hermes format's (prepare/structured.py forces calls in it)
END_TAG = "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI's API carries it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class CallFormat:
    name: str  # vLLM's parser name
    start: str  # opens a span of calls
    end: str | None  # closes it; None: the span runs to the end of the output
    parse: Callable[[str], list[ToolCall] | None]  # a span's body -> its calls; None if malformed
    # also open a span at the very start of the output (kept in the body)
    opens_output: tuple[str, ...] = ()
    # forced(names, argument schemas, tag, call index) -> the lark grammar of one call of one of
    # those functions in this markup (prepare/structured.py); None: this format is not forced
    forced: Callable | None = None
    # every marker of the markup (shown even where it is a special token)
    markers: tuple[str, ...] = ()
    # conversation(messages, tools) -> both as the family's template expects them
    # (prepare/chat.py); None: as they are
    conversation: Callable | None = None
    # how its calls stream while their span is open (tool_streams.py); None: each call whole
    # when its span closes (qwen3_coder, whose arguments are XML parameters, not JSON text)
    stream: CallStream | None = None
    # reader(first call index) -> a span's reader of its own, with SpanReader's extend / close /
    # announced (Llama 4's pythonic calls: output/llama4_tools.py); None: a SpanReader over `stream`
    reader: Callable | None = None
    # the markup before a reply's answer (harmony's `<|channel|>final<|message|>`): a
    # response_format grammar starts with it (prepare/structured.py)
    reply_head: tuple[str, ...] = ()


def call_from(name, arguments, call_id: str | None = None) -> ToolCall | None:
    """A call from a name and its arguments (a dict, or a JSON object's text); None if not one."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    text = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(name, text, call_id) if call_id else ToolCall(name, text)


def partial_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    for n in range(min(len(text), max(len(m) for m in markers) - 1), 0, -1):
        if any(m.startswith(text[-n:]) and len(m) > n for m in markers):
            return n
    return 0


class ToolCallParser:
    """One choice's text in, its content and its calls' deltas out (`read`, then `read_end`),
    in the order the model wrote them; `feed` and `finish` give the same as (content, calls
    finished). Announced calls are numbered across the turn, so several calls keep their own
    indices, and an abandoned one keeps its index."""

    def __init__(self, fmt: CallFormat | None = None):
        from services.gateway.output.tool_formats import HERMES

        self.fmt = fmt or HERMES
        self.buffer = ""
        self.in_call = False
        self.started = False  # any output seen (opens_output applies before it)
        self.tool_calls: list[ToolCall] = []  # finished
        self.num_calls = 0  # announced, abandoned ones included
        self.span: SpanReader | None = None  # or the format's own reader
        self.given = 0  # characters of the open span's body given to its reader
        self.opener = ""  # what opened the span: shown again if it turns out to be text

    def _open(self, opener: str) -> None:
        """`opener`: the marker that opened the span ("" for the start of the output)."""
        self.in_call, self.given, self.opener = True, 0, opener
        self.span = (
            self.fmt.reader(self.num_calls)
            if self.fmt.reader
            else SpanReader(self.fmt.stream or NO_STREAM, self.num_calls)
        )

    def _grow(self, visible: int) -> list[CallDelta]:
        """Gives the span's reader its body up to `visible`."""
        more, self.given = self.buffer[self.given : visible], max(visible, self.given)
        return self._counted(self.span.extend(more)) if more else []

    def _counted(self, deltas: list[CallDelta]) -> list[CallDelta]:
        for delta in deltas:
            if delta.kind == START:
                self.num_calls += 1
            elif delta.kind == DONE:
                self.tool_calls.append(delta.call)
        return deltas

    def _close(self, end: int, closed: bool) -> list[Part]:
        """Closes the span whose body is buffer[:end]: its calls' last deltas, or its text."""
        body = self.buffer[:end]
        parts: list[Part] = list(self._grow(end))
        calls = self.fmt.parse(body.strip()) if closed or self.fmt.end is None else None
        finished = self.span.close(calls)
        if finished is not None:
            return parts + self._counted(finished)
        parts += [CallDelta(ABANDONED, index) for index in self.span.announced()]
        return parts + [self.opener + body + (self.fmt.end or "" if closed else "")]

    def read(self, delta: str) -> list[Part]:
        """Content (str) and call deltas (CallDelta) that `delta` completes, in order: text
        that may be the start of a marker is held back until it is not."""
        self.buffer += delta
        parts: list[Part] = []
        fmt = self.fmt
        while True:
            if not self.started and fmt.opens_output:
                stripped = self.buffer.lstrip()
                if not stripped or any(
                    m.startswith(stripped) and m != stripped for m in fmt.opens_output
                ):
                    break  # too early to tell
                self.started = True
                if stripped.startswith(fmt.opens_output):
                    self.buffer = stripped
                    self._open("")
            self.started = self.started or bool(self.buffer)
            if self.in_call:
                end = self.buffer.find(fmt.end) if fmt.end else -1
                if end < 0:
                    keep = partial_suffix(self.buffer, (fmt.end,)) if fmt.end else 0
                    parts += self._grow(len(self.buffer) - keep)
                    break
                parts += self._close(end, closed=True)
                self.buffer = self.buffer[end + len(fmt.end) :]
                self.in_call = False
            else:
                start = self.buffer.find(fmt.start)
                if start < 0:
                    keep = partial_suffix(self.buffer, (fmt.start,))
                    parts.append(self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    break
                parts.append(self.buffer[:start])
                self.buffer = self.buffer[start + len(fmt.start) :]
                self._open(fmt.start)
        return [p for p in parts if p]

    def read_end(self) -> list[Part]:
        """End of the stream: text still held back, and the last deltas of a span that runs to
        the end (an unclosed span of a format with an end marker comes back as text)."""
        parts: list[Part] = [self.buffer]
        if self.in_call:
            parts = self._close(len(self.buffer), closed=False)
        self.buffer, self.in_call = "", False
        return [p for p in parts if p]

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        return content_and_calls(self.read(delta))

    def finish(self) -> tuple[str, list[ToolCall]]:
        return content_and_calls(self.read_end())


def content_and_calls(parts: list[Part]) -> tuple[str, list[ToolCall]]:
    """The content and the finished calls among `parts`."""
    return (
        "".join(p for p in parts if isinstance(p, str)),
        [p.call for p in parts if isinstance(p, CallDelta) and p.kind == DONE],
    )
