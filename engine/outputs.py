"""What the engine hands back: per-step outputs, finished completions, exported KV, its stats."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float] | None
    finished: bool
    finish_reason: str | None  # stop | length | abort | prefilled (prefill role: KV held)
    num_prompt_tokens: int
    num_cached_tokens: int
    stop_reason: object | None = None
    # prefill role, finish_reason "prefilled": the prompt's KV, copied out
    kv: KVExport | None = None
    # Per new token, params.top_logprobs (token id, logprob) pairs, most likely first; None when not asked.
    new_top_logprobs: list[list[tuple[int, float]]] | None = None
    num_draft_tokens: int = 0  # speculative decoding, so far: draft tokens verified
    num_accepted_draft_tokens: int = 0  # ... and kept (OpenAI's accepted_prediction_tokens)


@dataclass
class Completion:
    """A finished request, as `generate` returns it."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    top_logprobs: list[list[tuple[int, float]]] | None = None  # as RequestOutput.new_top_logprobs


@dataclass
class KVExport:
    """A prefilled sequence's KV, ready to move to a decode worker or a KV store."""

    request_id: str
    prompt_token_ids: list[int]
    first_token_id: int
    block_hashes: list[int]  # hashes of the full blocks (the last block may be partial)
    data: torch.Tensor  # [layers, num_blocks, 2, block_size, kv_heads, head_dim]


@dataclass(frozen=True)
class EngineStats:
    """The engine between two steps (`LLMEngine.stats`): what Health and the metrics report."""

    num_running: int = 0
    num_waiting: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0  # cached prefix blocks nobody holds count as free
    num_preemptions: int = 0  # since start
    num_draft_tokens: int = 0  # speculative decoding since start: draft tokens verified
    num_accepted_draft_tokens: int = 0  # ... and kept
    # prompt tokens admitted and not yet computed (the prefill load)
    num_prompt_tokens_pending: int = 0
    num_decode_tokens_running: int = 0  # context tokens of the requests decoding (the decode load)
    max_model_len: int = 0  # the context: prompt and output tokens of one request

    @property
    def idle(self) -> bool:
        return not (self.num_running or self.num_waiting)
