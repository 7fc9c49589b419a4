"""Prompt lookup: propose what followed the last earlier occurrence of the sequence's tail.

Agents' outputs copy their inputs (tool-call arguments, file contents, JSON keys), so the
tokens after the current n-gram's previous occurrence, in the prompt or the output so far,
are good guesses; where nothing matches, nothing is proposed and the step costs what a plain
decode costs. Each sequence keeps an index from n-gram to where it last ended, for n in
[min_n, max_n], extended by the tokens appended since the previous step: a proposal is a few
dictionary lookups, not a scan of the context.
"""

from __future__ import annotations

from typing import Optional

from engine.sequence import Sequence
from engine.speculative.base import Draft, Drafter


class NgramIndex:
    """Where each n-gram (min_n <= n <= max_n) of a token list last ended."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> the index just past its last occurrence
        self.num_indexed = 0  # n-grams ending before this index are in `ends`

    def extend(self, tokens: list[int], upto: int) -> None:
        """Indexes the n-grams of `tokens` ending at indexes up to `upto`."""
        for end in range(max(self.num_indexed, self.min_n), upto + 1):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.ends[tuple(tokens[end - n:end])] = end
        self.num_indexed = max(self.num_indexed, upto + 1)

    def follow(self, tail: list[int]) -> Optional[int]:
        """Where the longest indexed n-gram ending `tail` last ended; None when none is."""
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            end = self.ends.get(tuple(tail[-n:]))
            if end is not None:
                return end
        return None


class NgramDrafter(Drafter):
    def __init__(self, min_n: int = 2, max_n: int = 5):
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[Draft]:
        drafts = []
        for seq, k in zip(seqs, max_tokens):
            index = self._indexes.get(seq.request_id)
            if index is None:
                index = self._indexes[seq.request_id] = NgramIndex(self.min_n, self.max_n)
            tokens = seq.token_ids
            index.extend(tokens, len(tokens) - 1)  # all but the tail itself
            end = index.follow(tokens) if k > 0 else None
            drafts.append(Draft(tokens[end:end + k] if end is not None else []))
        return drafts

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)
