"""A request's life inside the engine: its tokens, its KV blocks, and why it finished."""

from __future__ import annotations

import enum

from engine.block_hash import salt_root
from engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    RUNNING = "running"
    PREFILLED = "prefilled"  # prefill role: first token out, blocks held for export
    FINISHED = "finished"


class Sequence:
    """One request. `token_ids` = prompt + output; KV exists for the first `num_computed_tokens`."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int,
        cache_salt: str = "",
    ):
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.seed = seed
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens whose KV came from the prefix cache
        self.num_preemptions = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # hashes of full blocks, filled as blocks fill
        self.root_hash = salt_root(cache_salt)  # its first block's parent (engine/block_hash.py)
        self.num_registered_blocks = 0  # leading blocks already in the prefix cache
        self.logprobs: list[float] = []
        self.grammar = None  # structured outputs: its llguidance matcher, following the output
        self.num_draft_tokens = 0  # speculative decoding: draft tokens verified for it
        self.num_accepted_draft_tokens = 0  # ... and kept
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.stop_reason: object | None = None  # the stop token id or stop string that hit

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )
