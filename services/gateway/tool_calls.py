"""Tool calls out of model text, as it streams, in the markup of the model's family
(tool_formats.py: one CallFormat a family, with vLLM's parser names).

Text outside a call span is content. A span opens at the format's start marker (or, for
formats that write bare JSON, at the start of the output) and closes at its end marker, or
at the end of the output where the format has none; its body is then parsed into calls.
`ToolCallParser.feed` returns the content that is safe to show now and the calls completed so
far: text that might be the start of a marker is held back until it is not, and a span whose
body does not parse, or that never closes, is shown as the text it was rather than lost.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Callable, Optional

START_TAG = "<tool_call>"  # the hermes format's (structured.py forces calls in it)
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
    end: Optional[str]  # closes it; None: the span runs to the end of the output
    parse: Callable[[str], Optional[list[ToolCall]]]  # a span's body -> its calls; None if malformed
    opens_output: tuple[str, ...] = ()  # also open a span at the very start of the output (kept in the body)
    # forced(names, argument schemas, tag, call index) -> the lark grammar of one call of one of
    # those functions in this markup (structured.py); None: this format is not forced
    forced: Optional[Callable] = None
    markers: tuple[str, ...] = ()  # every marker of the markup (shown even where it is a special token)
    # conversation(messages, tools) -> both as the family's template expects them (chat.py); None: as they are
    conversation: Optional[Callable] = None


def call_from(name, arguments, call_id: Optional[str] = None) -> Optional[ToolCall]:
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
    def __init__(self, fmt: Optional[CallFormat] = None):
        from services.gateway.tool_formats import HERMES

        self.fmt = fmt or HERMES
        self.buffer = ""
        self.in_call = False
        self.started = False  # any output seen (opens_output applies before it)
        self.tool_calls: list[ToolCall] = []

    def _close(self, body: str, closed: bool) -> tuple[str, list[ToolCall]]:
        calls = self.fmt.parse(body.strip()) if closed or self.fmt.end is None else None
        if calls:
            return "", calls
        opener = "" if self.fmt.opens_output and body.startswith(self.fmt.opens_output) else self.fmt.start
        return opener + body + (self.fmt.end or "" if closed else ""), []

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.buffer += delta
        content, calls = [], []
        fmt = self.fmt
        while True:
            if not self.started and fmt.opens_output:
                stripped = self.buffer.lstrip()
                if not stripped or any(m.startswith(stripped) and m != stripped for m in fmt.opens_output):
                    break  # too early to tell
                self.started = True
                if stripped.startswith(fmt.opens_output):
                    self.buffer, self.in_call = stripped, True
            self.started = self.started or bool(self.buffer)
            if self.in_call:
                end = self.buffer.find(fmt.end) if fmt.end else -1
                if end < 0:
                    break
                body, self.buffer = self.buffer[:end], self.buffer[end + len(fmt.end):]
                self.in_call = False
                text, found = self._close(body, closed=True)
                content.append(text)
                calls += found
            else:
                start = self.buffer.find(fmt.start)
                if start < 0:
                    keep = partial_suffix(self.buffer, (fmt.start,))
                    content.append(self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                content.append(self.buffer[:start])
                self.buffer = self.buffer[start + len(fmt.start):]
                self.in_call = True
        self.tool_calls += calls
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """End of the stream: text still held back, and the calls of a span that runs to the end
        (an unclosed span of a format with an end marker comes back as text)."""
        rest, calls = self.buffer, []
        if self.in_call:
            rest, calls = self._close(self.buffer, closed=False)
        self.buffer, self.in_call = "", False
        self.tool_calls += calls
        return rest, calls
