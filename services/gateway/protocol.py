"""The gateway's own request and event types: plain typed Python, no protobuf.

The edges convert into these (the gRPC servicer from protobuf, the OpenAI HTTP adapter from
its pydantic models) and out of them, and everything between (validation, templates,
admission, routing, detokenization) reads only these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.gateway.output.tool_calls import ToolCall
from services.gateway.output.tool_streams import CallDelta

# A worker's store tiers (its StoreTokens) -> their names in cached_tokens_by_tier.
STORE_TIERS = {
    "dram": "store_dram",
    "disk": "store_disk",
    "mooncake": "mooncake_dram",
    "mooncake_disk": "mooncake_disk",
}


@dataclass(frozen=True)
class SamplingOptions:
    """How to sample, as the client asked. `max_tokens` None: as many as the context holds
    (resolved per prompt before a request reaches a worker)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    prediction: str = ""  # Predicted Outputs: text the reply will largely repeat (speed only)
    # structured outputs: the llguidance grammar the reply follows (prepare/structured.py)
    grammar: str = ""


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]  # JSON-shaped: role, content (a string or text parts), tool_calls, ...
    options: SamplingOptions
    model: str = ""
    tools: list[dict] | None = None  # JSON-shaped OpenAI function tools
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", ...}
    response_format: dict | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    n: int = 1
    session: str = ""  # x-session-affinity
    # The model's reasoning switch (Anthropic's thinking, OpenAI's reasoning): None leaves the
    # template's default; True / False reach the template as enable_thinking and thinking.
    reasoning: bool | None = None
    # how hard to think, as the client said it (low, medium, high, ...; "" not said): gpt-oss's
    # harmony system message reads it (prepare/harmony.py); templates read `reasoning`
    reasoning_effort: str = ""
    template_kwargs: dict | None = None  # chat_template_kwargs: more variables for the template
    cache_salt: str = ""  # vLLM's: the prompt's cached prefix is shared only under the same salt


@dataclass(frozen=True)
class CompletionRequest:
    prompts: list[str | list[int]]  # text, or token ids
    options: SamplingOptions
    model: str = ""
    n: int = 1
    session: str = ""  # x-session-affinity
    cache_salt: str = ""  # as ChatRequest's


@dataclass(frozen=True)
class GenerationRequest:
    """One sequence for a worker to generate: one (prompt, choice) of a public request."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions  # max_tokens resolved
    session: str = ""  # x-session-affinity: route back to the session's worker
    prediction_token_ids: list[int] = field(default_factory=list)  # sampling.prediction, tokenized
    # salts the prompt's block hashes on the workers and in routing (engine/block_hash.py):
    # the request's cache_salt, combined with its API key's (prepare/requests.py key_salted)
    cache_salt: str = ""


@dataclass
class TokenChunk:
    """What a worker streamed back: new tokens, and the finish once there is one."""

    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None  # stop | length | abort
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # of the cached: loaded from the KV store, by tier
    store_tokens: dict[str, int] = field(default_factory=dict)
    stop_string: str = ""
    num_draft_tokens: int = 0  # speculative decoding, so far: draft tokens verified
    num_accepted_draft_tokens: int = 0  # ... and kept


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0  # from the worker that computed the prompt
    # of those, loaded from a KV store, by its tier: dram, disk (built-in), mooncake
    store_tokens: dict[str, int] = field(default_factory=dict)
    accepted_prediction_tokens: int = 0  # speculative decoding: draft tokens kept
    rejected_prediction_tokens: int = 0  # ... and computed, then dropped
    reasoning_tokens: int = 0  # of the completion tokens, the reasoning's

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def cached_tokens_by_tier(self) -> dict[str, int]:
        loaded = {name: self.store_tokens.get(tier, 0) for tier, name in STORE_TIERS.items()}
        return {"local": self.cached_tokens - sum(loaded.values()), **loaded}


class Usages:
    """A request's usage over its choices: each prompt counted once (its cached tokens from
    the choice that got the fewest), every choice's completion tokens."""

    def __init__(self, n: int):
        self.n = n
        self.by_choice: dict[int, Usage] = {}

    def add(self, finish: Finish) -> None:
        self.by_choice[finish.index] = finish.usage

    def total(self) -> Usage:
        total = Usage(prompt_tokens=0)
        prompts: dict[int, list[Usage]] = {}
        for index, usage in self.by_choice.items():
            prompts.setdefault(index // self.n, []).append(usage)
            total.completion_tokens += usage.completion_tokens
            total.accepted_prediction_tokens += usage.accepted_prediction_tokens
            total.rejected_prediction_tokens += usage.rejected_prediction_tokens
            total.reasoning_tokens += usage.reasoning_tokens
        for usages in prompts.values():
            total.prompt_tokens += usages[0].prompt_tokens
            least = min(usages, key=lambda u: u.cached_tokens)
            total.cached_tokens += least.cached_tokens
            for tier, n in least.store_tokens.items():
                total.store_tokens[tier] = total.store_tokens.get(tier, 0) + n
        return total


@dataclass
class TokenLogprob:
    token: str
    logprob: float
    top: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class Delta:
    index: int  # the choice
    text: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)  # finished: what a unary reply returns
    # the calls' steps, after `text` (output/tool_streams.py): announced, arguments, done or
    # abandoned; what a stream sends. A call's "arguments" joined equal its finished arguments.
    call_deltas: list[CallDelta] = field(default_factory=list)
    reasoning: str = ""  # what the model thought (output/reasoning.py), before its answer
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # the choice's so far (the object its Finish carries): prompt and cached tokens
    usage: Usage | None = None


@dataclass
class Finish:
    index: int
    reason: str  # stop | length | tool_calls | abort
    usage: Usage
    stop_string: str = ""  # the stop string that ended it, if one did


Event = Delta | Finish
