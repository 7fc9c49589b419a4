"""Speculative decoding: drafters propose, the target verifies in the same step.

`base.py` the drafter contract; `ngram.py` prompt lookup; `draft_model.py` a small draft checkpoint;
`eagle3.py` a head over the target's hidden states; `prediction.py` OpenAI's Predicted Outputs;
`speculator.py` who drafts how far; `tuner.py` how far pays; `verify.py` what is kept.
"""

from __future__ import annotations

from engine.speculative.base import Draft, Drafter
from engine.speculative.ngram import NgramDrafter
from engine.speculative.speculator import Speculator

DRAFTERS = ("off", "ngram", "draft", "eagle3")


def create_drafter(name: str, engine=None, draft_model: str | None = None) -> Drafter | None:
    """The drafter called `name`; `draft` and `eagle3` load `draft_model` (a draft checkpoint,
    an EAGLE-3 head) beside `engine` (the target), with as many KV blocks as the target's pool
    (a draft's blocks are smaller)."""
    if name == "off":
        return None
    if name == "ngram":
        return NgramDrafter()
    if name == "draft":
        if not draft_model or engine is None:
            raise ValueError("speculative 'draft' needs a draft model folder (--draft-model)")
        from engine.speculative.draft_model import DraftModelDrafter

        return DraftModelDrafter(
            draft_model,
            engine.model_config.vocab_size,
            engine.num_blocks,
            engine.config.block_size,
            engine.max_model_len,
            engine.dtype,
            engine.device,
        )
    if name == "eagle3":
        if not draft_model or engine is None:
            raise ValueError("speculative 'eagle3' needs the head's folder (--draft-model)")
        from engine.speculative.eagle3 import Eagle3Drafter

        return Eagle3Drafter(
            draft_model,
            engine.model_config,
            engine.model.embedding_table(),
            engine.num_blocks,
            engine.config.block_size,
            engine.max_model_len,
            engine.dtype,
            engine.device,
        )
    raise ValueError(f"unknown speculative method {name!r}; choose from {', '.join(DRAFTERS)}")


__all__ = ["DRAFTERS", "Draft", "Drafter", "Speculator", "create_drafter"]
