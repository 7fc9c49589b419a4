"""Tool calls out of model text, as it streams: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

The demo model's chat template (and Qwen/Hermes-style templates) write tool calls this way.
`ToolCallParser.feed` returns the plain text that is safe to show now and every tool call
completed so far. Text that might be the start of a tag is held back until it is not; a span
whose JSON does not parse, or that never closes, is shown as plain text rather than lost.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

START_TAG = "<tool_call>"
END_TAG = "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI's API carries it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def _parse(body: str) -> ToolCall | None:
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments already encoded
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(call["name"], json.dumps(arguments, ensure_ascii=False))


def _partial_tag_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    def __init__(self):
        self.buffer = ""
        self.in_call = False
        self.tool_calls: list[ToolCall] = []

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.buffer += delta
        content, calls = [], []
        while True:
            if self.in_call:
                end = self.buffer.find(END_TAG)
                if end < 0:
                    break
                body, self.buffer = self.buffer[:end], self.buffer[end + len(END_TAG) :]
                self.in_call = False
                call = _parse(body.strip())
                if call is None:
                    content.append(START_TAG + body + END_TAG)
                else:
                    calls.append(call)
            else:
                start = self.buffer.find(START_TAG)
                if start < 0:
                    keep = _partial_tag_suffix(self.buffer, START_TAG)
                    content.append(self.buffer[: len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep :]
                    break
                content.append(self.buffer[:start])
                self.buffer = self.buffer[start + len(START_TAG) :]
                self.in_call = True
        self.tool_calls += calls
        return "".join(content), calls

    def finish(self) -> str:
        """End of the stream: text still held back (an unclosed call comes back as text)."""
        rest = (START_TAG if self.in_call else "") + self.buffer
        self.buffer, self.in_call = "", False
        return rest
