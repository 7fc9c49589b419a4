"""gpt-oss's replies in harmony, read token by token with openai-harmony's StreamableParser.

A reply is a run of messages, `<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]<|message|>TEXT`,
each ended by <|end|> (and the next opened by `<|start|>assistant`), <|call|> or <|return|>:
- `analysis`: reasoning (chat's reasoning_content, Responses' reasoning items, Messages'
  thinking blocks);
- a message to `functions.NAME` (on `commentary`): a call of NAME, announced when its header
  ends; its text is the arguments, streamed as far as it is a JSON prefix (json_prefix.py), and
  the call is done when the message ends if the text is one JSON object, else abandoned and its
  text shown as content;
- `final`, and `commentary` to no one (a preamble before calls): content.
Without tools (`calls` off) a call's text is content; without a reasoning parser, so is
analysis. `HarmonyReader.deltas` turns a chunk's tokens into Deltas in the order the model
wrote them (each Delta's reasoning before its text, its text before its call steps), as
generation.py's text parsers do; stop strings are cut from the content as there. A reply that
breaks the format (the parser raises) is shown from that token on as the text it decodes to.
"""

from __future__ import annotations

import json

from services.gateway.output.detokenizer import IncrementalDetokenizer
from services.gateway.output.json_prefix import JsonPrefix
from services.gateway.output.stops import StopTrimmer
from services.gateway.output.tool_calls import ToolCall
from services.gateway.output.tool_streams import ABANDONED, ARGUMENTS, DONE, START, CallDelta
from services.gateway.protocol import Delta, TokenChunk

# vLLM's parser names for it: --tool-call-parser openai, --reasoning-parser openai_gptoss
CALL_FORMAT, REASONING_FORMAT = "openai", "openai_gptoss"
MESSAGE = 200008  # <|message|>: a header ends, its text begins
MESSAGE_ENDS = frozenset((200007, 200012, 200002))  # <|end|>, <|call|>, <|return|>
FUNCTIONS = "functions."
MAX_HEADER = 64  # tokens: a header longer than this is not one (the reply is not harmony)


def speaks_harmony(tool_format, reasoning_format) -> bool:
    """Whether a reply parsed in these formats is harmony (read here, token by token)."""
    return (tool_format is not None and tool_format.name == CALL_FORMAT) or (
        reasoning_format is not None and reasoning_format.name == REASONING_FORMAT
    )


class _Call:
    """One message to a function: its arguments as they stream."""

    def __init__(self, index: int, name: str):
        self.index, self.name = index, name
        self.id = ToolCall(name, "").id
        self.text = ""  # the message's text
        self.start = -1  # where the arguments' `{` is, once seen
        self.json = JsonPrefix()
        self.sent = 0  # characters of the arguments sent

    def extend(self, text: str) -> str:
        """Reads more of the text; returns the arguments it decides."""
        self.text += text
        if self.start < 0:
            stripped = self.text.lstrip()
            if not stripped:
                return ""
            self.start = len(self.text) - len(stripped)
            text = stripped
            if not stripped.startswith("{"):
                self.json.failed = True
        if not self.json.failed and self.json.end is None:
            self.json.feed(text)
        decided = self.text[self.start + self.sent : self.start + self.json.decided]
        self.sent += len(decided)
        return decided

    def arguments(self) -> str | None:
        """The arguments, once the text is one whole JSON object (and nothing after it)."""
        if self.json.failed or self.json.end is None:
            return None
        end = self.start + self.json.end
        if self.text[end:].strip():
            return None
        raw = self.text[self.start : end]
        return raw if isinstance(json.loads(raw), dict) else None


class HarmonyReader:
    """One choice's reply tokens in, Deltas out (`deltas`); `reasoning_tokens` and
    `tool_calls` (finished) so far."""

    def __init__(self, tokenizer, stops: tuple[str, ...], reasoning: bool, calls: bool):
        from openai_harmony import Role, StreamableParser

        from engine.o200k import harmony_encoding

        self.parser = StreamableParser(harmony_encoding(), Role.ASSISTANT)
        self.reasoning_on, self.calls_on = reasoning, calls
        self.trimmer = StopTrimmer(stops)
        self.kind = ""  # of the open message: reasoning | content | call ("": between messages)
        self.call: _Call | None = None
        self.num_calls = 0  # announced, abandoned ones included
        self.tool_calls: list[ToolCall] = []
        self.reasoning_tokens = 0
        self.broken: IncrementalDetokenizer | None = None  # the rest as text, once broken
        self.tokenizer = tokenizer
        self.header: list[int] = []  # the tokens since the last message ended
        self.num_messages = 0

    def deltas(self, index: int, chunk: TokenChunk) -> list[Delta]:
        out = [Delta(index)]
        for token in chunk.token_ids:
            self._token(token, out)
        if chunk.finish_reason is not None:
            self._finish(chunk.finish_reason, chunk.stop_string, out)
        return [d for d in out if d.text or d.reasoning or d.call_deltas] or out[:1]

    def _break(self, tokens: list[int], out: list[Delta]) -> None:
        """Not harmony from here on: `tokens` and the rest are shown as the text they are."""
        self.kind, self.broken = "content", IncrementalDetokenizer(self.tokenizer)
        self._text(self.broken.add(tokens), out)

    def _token(self, token: int, out: list[Delta]) -> None:
        if self.broken is not None:
            return self._text(self.broken.add([token]), out)
        from openai_harmony import HarmonyError

        try:
            self.parser.process(token)
        except HarmonyError:
            return self._break(self.header + [token], out)
        if not self.kind:
            self.header.append(token)
            if token == MESSAGE:
                self.header = []
                self._open(out)
            elif len(self.header) > MAX_HEADER:
                self._break(self.header, out)
        elif token in MESSAGE_ENDS:
            self._close(out)
        else:
            self.reasoning_tokens += self.kind == "reasoning"
            self._text(self.parser.last_content_delta or "", out)

    def _open(self, out: list[Delta]) -> None:
        self.num_messages += 1
        recipient = self.parser.current_recipient or ""
        if recipient.startswith(FUNCTIONS) and self.calls_on:
            self.kind, self.call = "call", _Call(self.num_calls, recipient[len(FUNCTIONS) :])
            self.num_calls += 1
            out[-1].call_deltas.append(
                CallDelta(START, self.call.index, self.call.id, self.call.name)
            )
        elif self.parser.current_channel == "analysis" and self.reasoning_on:
            self.kind = "reasoning"
        else:
            self.kind = "content"

    def _text(self, text: str, out: list[Delta]) -> None:
        if not text:
            return
        if self.kind == "reasoning":
            if out[-1].text or out[-1].call_deltas:
                out.append(Delta(out[-1].index))
            out[-1].reasoning += text
        elif self.kind == "call":
            decided = self.call.extend(text)
            if decided:
                out[-1].call_deltas.append(CallDelta(ARGUMENTS, self.call.index, arguments=decided))
        else:
            self._content(self.trimmer.feed(text), out)

    def _content(self, text: str, out: list[Delta]) -> None:
        if text:
            if out[-1].call_deltas:
                out.append(Delta(out[-1].index))
            out[-1].text += text

    def _close(self, out: list[Delta], complete: bool = True) -> None:
        """The open message ends (`complete`: by its end token, or the reply's end)."""
        kind, call, self.kind, self.call = self.kind, self.call, "", None
        if kind == "content":  # a stop string never spans two messages
            self._content(self.trimmer.finish("", ""), out)
        if call is None:
            return
        arguments = call.arguments() if complete else None
        if arguments is None:
            out[-1].call_deltas.append(CallDelta(ABANDONED, call.index))
            return self._content(self.trimmer.feed(call.text), out)
        finished = ToolCall(call.name, arguments, call.id)
        if arguments[call.sent :]:
            out[-1].call_deltas.append(
                CallDelta(ARGUMENTS, call.index, arguments=arguments[call.sent :])
            )
        out[-1].call_deltas.append(CallDelta(DONE, call.index, call=finished))
        out[-1].tool_calls.append(finished)
        self.tool_calls.append(finished)

    def _finish(self, reason: str, stop_string: str, out: list[Delta]) -> None:
        if self.broken is not None:
            self._text(self.broken.flush(), out)
        elif not self.num_messages and self.header:  # no header ever ended: plain text
            self._break(self.header, out)
            self._text(self.broken.flush(), out)
        elif self.kind:  # the worker stopped inside a message (its end token not streamed)
            self._close(out, complete=reason != "length")
        self._content(self.trimmer.finish("", stop_string), out)
