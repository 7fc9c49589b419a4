"""Per-request sampling parameters: plain data, checked on construction."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 means greedy. top_k <= 0, top_p == 1 and min_p == 0 disable those filters.
    A request without a seed gets a random one when it is added, so its stream of random
    numbers is still fixed per request (and survives preemption and batching).
    `logprobs` returns the log-probability of each chosen token under the model's raw
    distribution (before temperature and filters), as OpenAI and vLLM report it.
    `top_logprobs` k > 0 also returns, per token, the k most likely tokens under that same
    distribution (OpenAI's `top_logprobs` / completions' `logprobs: k`); it implies `logprobs`.
    `prediction`: tokens the reply is expected to repeat (OpenAI's Predicted Outputs), drafted
    from for speculative decoding; it never changes what is generated, only how fast.
    `grammar`: an llguidance grammar the reply must follow (structured outputs; engine/grammar.py).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    prediction: tuple[int, ...] = ()
    grammar: str = ""

    def __post_init__(self):
        # Accept lists from callers; keep the dataclass hashable and immutable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "prediction", tuple(self.prediction))
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.temperature <= 100:
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequestError(f"seed must be in [0, 2**63), got {self.seed}")
        if any(not s for s in self.stop):
            raise InvalidRequestError("stop strings must not be empty")
        if not 0 <= self.top_logprobs <= 20:
            raise InvalidRequestError(f"top_logprobs must be in [0, 20], got {self.top_logprobs}")
        if self.top_logprobs:  # the chosen token's logprob comes with its top list
            object.__setattr__(self, "logprobs", True)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
