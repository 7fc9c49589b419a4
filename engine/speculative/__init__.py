"""Speculative decoding: drafters propose, the target verifies in the same step.

`base.py` the drafter contract; `ngram.py` prompt lookup; `prediction.py` OpenAI's
Predicted Outputs; `speculator.py` who drafts how far; `verify.py` what is kept.
"""

from __future__ import annotations

from typing import Optional

from engine.speculative.base import Draft, Drafter
from engine.speculative.ngram import NgramDrafter
from engine.speculative.speculator import Speculator

DRAFTERS = ("off", "ngram")


def create_drafter(name: str) -> Optional[Drafter]:
    if name == "off":
        return None
    if name == "ngram":
        return NgramDrafter()
    raise ValueError(f"unknown speculative method {name!r}; choose from {', '.join(DRAFTERS)}")


__all__ = ["DRAFTERS", "Draft", "Drafter", "Speculator", "create_drafter"]
