"""One sequence's output stream: the worker pool's token chunks in, text, tool-call and
logprob deltas and a finish out; its latency and token metrics recorded on the way.

Transport-free: the gRPC servicer and the HTTP adapter both wrap these events. A reply is read
by one of two readers, each a chunk's tokens in and Deltas out: `_TextReader` detokenizes and
parses the text with the family's reasoning and tool-call parsers; gpt-oss's harmony, whose
channels are tokens, is read by output/harmony.py. Stop strings are cut from the text as OpenAI
does (stops.py).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import grpc

from services.gateway import metrics
from services.gateway.errors import GatewayError
from services.gateway.output.detokenizer import IncrementalDetokenizer
from services.gateway.output.harmony import HarmonyReader, speaks_harmony
from services.gateway.output.reasoning import ReasoningFormat, ReasoningParser, starts_inside
from services.gateway.output.stops import StopTrimmer
from services.gateway.output.tool_calls import CallFormat, ToolCallParser
from services.gateway.output.tool_streams import DONE
from services.gateway.protocol import (
    Delta,
    Event,
    Finish,
    GenerationRequest,
    TokenChunk,
    TokenLogprob,
    Usage,
)


class _Timings:
    """TTFT, inter-token latency and TPOT of one sequence, from its arrival at the gateway."""

    def __init__(self, arrived: float):
        self.arrived = arrived
        self.first = self.last = 0.0

    def tokens(self, n: int) -> None:
        now = time.monotonic()
        if not self.first:
            self.first = now
            metrics.TTFT.observe(now - self.arrived)
        elif n:
            gap = (now - self.last) / n
            for _ in range(n):
                metrics.ITL.observe(gap)
        self.last = now

    def finish(self, usage: Usage, reason: str) -> None:
        metrics.E2E.observe(time.monotonic() - self.arrived)
        if usage.completion_tokens > 1:
            metrics.TPOT.observe((self.last - self.first) / (usage.completion_tokens - 1))
        metrics.REQUEST_SUCCESS.labels(reason).inc()
        metrics.PROMPT_TOKENS.observe(usage.prompt_tokens)
        metrics.GENERATION_TOKENS.observe(usage.completion_tokens)
        metrics.PROMPT_TOKENS_TOTAL.inc(usage.prompt_tokens)
        metrics.GENERATION_TOKENS_TOTAL.inc(usage.completion_tokens)
        metrics.CACHED_TOKENS.inc(usage.cached_tokens)
        for tier, tokens in usage.cached_tokens_by_tier().items():
            metrics.CACHED_TOKENS_BY_TIER.labels(tier).inc(tokens)


class _Logprobs:
    """Token ids and their logprobs as OpenAI shows them: each token's own text."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def of(self, chunk: TokenChunk) -> list[TokenLogprob]:
        return [
            TokenLogprob(self.text(t), lp, [(self.text(i), v) for i, v in top])
            for t, lp, top in zip(
                chunk.token_ids, chunk.logprobs, chunk.top_logprobs or [[]] * len(chunk.token_ids)
            )
        ]


class _Channels:
    """Text split into reasoning and content (reasoning.py), then tool calls out of the content
    (tool_calls.py): each part the model's own markup, or the text as it is.

    One chunk of tokens may hold text, a call's end, more text and the next call's start
    (speculative decoding verifies several at once), so it becomes as many Deltas as keep that
    order: each Delta's text comes before its call steps."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None):
        self.reasoning, self.tools = reasoning, tools

    def deltas(self, index: int, text: str, finished: bool) -> list[Delta]:
        thought = ""
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(text)
            if finished:
                more_thought, more_text = self.reasoning.finish()
                thought, text = thought + more_thought, text + more_text
        if self.tools is None:
            return [Delta(index, text=text, reasoning=thought)]
        parts = self.tools.read(text) + (self.tools.read_end() if finished else [])
        out = [Delta(index, reasoning=thought)]
        for part in parts:
            if isinstance(part, str):
                if out[-1].call_deltas:
                    out.append(Delta(index))
                out[-1].text += part
            else:
                out[-1].call_deltas.append(part)
                if part.kind == DONE:
                    out[-1].tool_calls.append(part.call)
        # One Delta a step at least (a stream sends a chunk for each step's tokens), and no
        # empty one beside those that carry something.
        return [d for d in out if d.text or d.reasoning or d.call_deltas] or out[:1]


def _reasoning(
    tokenizer, request: GenerationRequest, fmt: ReasoningFormat | None
) -> ReasoningParser | None:
    if fmt is None:
        return None
    # Enough of the prompt's end to hold the opening tag, whatever the vocabulary splits it into.
    tail = tokenizer.decode(request.prompt_token_ids[-32:], skip_special_tokens=False)
    return ReasoningParser(fmt, starts_inside(fmt, tail))


class _TextReader:
    """The reply as text (detokenized, stop strings cut), then split by `_Channels`."""

    def __init__(
        self,
        tokenizer,
        request: GenerationRequest,
        tool_format: CallFormat | None,
        reasoning_format: ReasoningFormat | None,
    ):
        # The markup the parsers read, shown even where the vocabulary makes it special tokens.
        markers = (tool_format.markers if tool_format else ()) + (
            reasoning_format.markers if reasoning_format else ()
        )
        self.detok = IncrementalDetokenizer(
            tokenizer, keep=tokenizer.special_markup(markers) if markers else frozenset()
        )
        self.trimmer = StopTrimmer(request.sampling.stop)
        self.tools = ToolCallParser(tool_format) if tool_format is not None else None
        self.channels = _Channels(_reasoning(tokenizer, request, reasoning_format), self.tools)
        self.tokenizer = tokenizer

    def deltas(self, index: int, chunk: TokenChunk) -> list[Delta]:
        text = self.detok.add(chunk.token_ids)
        if chunk.finish_reason is not None:
            text = self.trimmer.finish(text + self.detok.flush(), chunk.stop_string)
        else:
            text = self.trimmer.feed(text)
        return self.channels.deltas(index, text, chunk.finish_reason is not None)

    @property
    def tool_calls(self) -> list:
        return self.tools.tool_calls if self.tools is not None else []

    @property
    def reasoning_tokens(self) -> int:
        thought = self.channels.reasoning.reasoning if self.channels.reasoning else ""
        return len(self.tokenizer.encode(thought)) if thought else 0


def _reader(tokenizer, request, tool_format, reasoning_format):
    if speaks_harmony(tool_format, reasoning_format):
        return HarmonyReader(
            tokenizer,
            request.sampling.stop,
            reasoning=reasoning_format is not None,
            calls=tool_format is not None,
        )
    return _TextReader(tokenizer, request, tool_format, reasoning_format)


async def generation_events(
    chunks: AsyncIterator[TokenChunk],
    tokenizer,
    request: GenerationRequest,
    index: int,
    tool_format: CallFormat | None,
    arrived: float,
    reasoning_format: ReasoningFormat | None = None,
) -> AsyncIterator[Event]:
    """The events of choice `index`, from `request`'s token chunks as the workers stream them
    (WorkerPool.generate). `tool_format`: parse tool calls out of the reply in this markup;
    `reasoning_format`: reasoning out of it first (None: the text as it is)."""
    reader = _reader(tokenizer, request, tool_format, reasoning_format)
    logprobs = (
        _Logprobs(tokenizer) if request.sampling.logprobs or request.sampling.top_logprobs else None
    )
    usage = Usage(prompt_tokens=len(request.prompt_token_ids))
    timings = _Timings(arrived)
    async for chunk in chunks:
        timings.tokens(len(chunk.token_ids))
        usage.completion_tokens += len(chunk.token_ids)
        usage.cached_tokens, usage.store_tokens = chunk.num_cached_tokens, chunk.store_tokens
        usage.accepted_prediction_tokens = chunk.num_accepted_draft_tokens
        usage.rejected_prediction_tokens = chunk.num_draft_tokens - chunk.num_accepted_draft_tokens
        finished = chunk.finish_reason is not None
        deltas = reader.deltas(index, chunk)
        if finished:
            usage.reasoning_tokens = reader.reasoning_tokens
        if logprobs is not None:
            deltas[0].logprobs = logprobs.of(chunk)
        for delta in deltas:
            delta.usage = usage
            yield delta
        if finished:
            reason = chunk.finish_reason
            if reader.tool_calls and reason == "stop":
                reason = "tool_calls"
            timings.finish(usage, reason)
            yield Finish(index, reason, usage, chunk.stop_string)
            return
    raise GatewayError(
        grpc.StatusCode.UNAVAILABLE, "the worker ended the stream before the request finished"
    )
