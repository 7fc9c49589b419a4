"""When a request ends: at a stop token or end-of-sequence token, at a stop string in the
decoded tail of its output, or at its length limit (`max_tokens`, or the context)."""

from __future__ import annotations

from collections.abc import Iterable

from engine.sequence import Sequence

# Tokens decoded beyond the longest stop string's length in characters: a character may
# take several tokens (byte fallback), and the tail's first token may be cut mid-character.
TAIL_TOKENS = 4


class StopChecker:
    def __init__(self, eos_token_ids: Iterable[int], tokenizer, max_model_len: int):
        self.eos_token_ids = set(eos_token_ids)
        self.tokenizer: object | None = tokenizer  # needed only by requests with stop strings
        self.max_model_len = max_model_len

    def check(self, seq: Sequence, token: int) -> None:
        """Sets `seq.finish_reason` (and `stop_reason`) if `token`, just appended, ends it."""
        params = seq.params
        if token in params.stop_token_ids or (
            not params.ignore_eos and token in self.eos_token_ids
        ):
            seq.finish_reason, seq.stop_reason = "stop", token
        elif params.stop:
            longest = max(len(s) for s in params.stop)
            tail = self.tokenizer.decode(seq.output_token_ids[-(longest + TAIL_TOKENS) :])
            hit = next((s for s in params.stop if s in tail), None)
            if hit is not None:
                seq.finish_reason, seq.stop_reason = "stop", hit
        if seq.finish_reason is None and (
            seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len
        ):
            seq.finish_reason = "length"
