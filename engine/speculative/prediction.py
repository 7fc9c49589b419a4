"""OpenAI's Predicted Outputs as a draft: `prediction: {"type": "content", "content": ...}`.

The request names text the reply will largely repeat (a file with a small edit, a JSON
document with one field changed). The draft follows the prediction from where the output
has reached in it: a cursor advances while each new output token equals the prediction's
next one. When the output departs from the prediction (an edit), the cursor is lost and
found again after the longest n-gram (down to one token) ending the output, at its last
occurrence in the prediction.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sequence import Sequence
from engine.speculative.base import Draft, Drafter
from engine.speculative.ngram import NgramIndex

NGRAM_SIZES = tuple(range(1, 9))  # down to one token


@dataclass
class _Cursor:
    index: NgramIndex = field(default_factory=lambda: NgramIndex(NGRAM_SIZES))
    position: int | None = 0  # where in the prediction the output goes on; None: lost
    num_seen: int = 0  # output tokens already followed


class PredictionDrafter(Drafter):
    def __init__(self):
        self._cursors: dict[str, _Cursor] = {}

    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[Draft]:
        drafts = []
        for seq, k in zip(seqs, max_tokens):
            prediction = seq.params.prediction
            cursor = self._cursors.get(seq.request_id)
            if cursor is None:
                cursor = self._cursors[seq.request_id] = _Cursor()
                cursor.index.extend(list(prediction), len(prediction) - 1)
            output = seq.output_token_ids
            for token in output[cursor.num_seen :]:
                at = cursor.position
                on_track = at is not None and at < len(prediction) and prediction[at] == token
                cursor.position = at + 1 if on_track else None
            cursor.num_seen = len(output)
            if cursor.position is None:
                found = cursor.index.follow(output)
                cursor.position = found[0] if found is not None else None
            at = cursor.position
            drafts.append(Draft(list(prediction[at : at + k]) if at is not None else []))
        return drafts

    def forget(self, request_id: str) -> None:
        self._cursors.pop(request_id, None)
