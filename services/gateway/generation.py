"""One request's output stream: worker tokens in, text and tool-call deltas and a finish out.

Transport-free: the gRPC servicer and the HTTP adapter both wrap these events. Stop strings
are cut from the text as OpenAI does; while a stop string could still be forming, its
possible start is held back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Union

import grpc

from services.gateway.detokenizer import IncrementalDetokenizer
from services.gateway.errors import GatewayError
from services.gateway.tool_calls import ToolCall, ToolCallParser
from services.gateway.worker_pool import WorkerPool
from tandem.v1 import worker_pb2

FINISH_REASONS = {worker_pb2.FINISH_REASON_STOP: "stop", worker_pb2.FINISH_REASON_LENGTH: "length",
                  worker_pb2.FINISH_REASON_ABORT: "abort"}


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0  # from the worker that computed the prompt


@dataclass
class Delta:
    text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class Finish:
    reason: str  # stop | length | tool_calls
    usage: Usage


Event = Union[Delta, Finish]


class _StopTrimmer:
    """Holds back text that may be the start of a stop string; cuts the stop string off.

    The worker stops at the first stop string, so no complete one is in earlier text, and
    holding back (longest stop - 1) characters keeps every partial one unshown.
    """

    def __init__(self, stops: list[str]):
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""

    def feed(self, text: str) -> str:
        self.pending += text
        cut = max(len(self.pending) - self.hold, 0)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def finish(self, text: str, stop_string: str) -> str:
        rest, self.pending = self.pending + text, ""
        position = rest.find(stop_string) if stop_string else -1
        return rest if position < 0 else rest[:position]


def generate(pool: WorkerPool, tokenizer, request: worker_pb2.GenerateRequest, parse_tools: bool,
             on_cancel) -> Iterator[Event]:
    detok = IncrementalDetokenizer(tokenizer)
    trimmer = _StopTrimmer(list(request.sampling.stop))
    tools = ToolCallParser() if parse_tools else None
    usage = Usage(prompt_tokens=len(request.prompt_token_ids))
    for response in pool.generate(request, on_cancel):
        usage.completion_tokens += len(response.token_ids)
        usage.cached_tokens = response.num_cached_tokens
        text = detok.add(list(response.token_ids))
        finished = response.finish_reason != worker_pb2.FINISH_REASON_UNSPECIFIED
        text = trimmer.finish(text + detok.flush(), response.stop_string) if finished else trimmer.feed(text)
        yield _delta(text, tools)
        if finished:
            reason = FINISH_REASONS.get(response.finish_reason, "stop")
            if tools is not None:
                yield Delta(text=tools.finish())
                if tools.tool_calls and reason == "stop":
                    reason = "tool_calls"
            yield Finish(reason, usage)
            return
    raise GatewayError(grpc.StatusCode.UNAVAILABLE, "the worker ended the stream before the request finished")


def _delta(text: str, tools: ToolCallParser | None) -> Delta:
    if tools is None:
        return Delta(text=text)
    content, calls = tools.feed(text)
    return Delta(text=content, tool_calls=calls)
