"""Prompt lookup: propose what followed the last earlier occurrence of the sequence's tail.

Agents' outputs copy their inputs (tool-call arguments, file contents, JSON keys) and repeat
their own earlier shapes (every tool call is the same envelope), so the tokens after the
current n-gram's previous occurrence are good guesses: in the sequence itself (prompt and
output so far), or in the outputs of recent requests (a shared history of HISTORY_TOKENS,
as SuffixDecoding keeps). Each output enters the history behind the last tokens of its prompt,
so a new reply's first tokens match too (chat prompts end in the same assistant header; a
tool call's envelope then comes in one draft). The longer match wins, the sequence's own on a
tie. The history also matches n-grams of 8 and 12 tokens: a longer context tells a tool call's
`{"name": "` (the history's) from the tool list's (the prompt's). A sequence's own index, built
over each whole prompt, keeps to 2-5 tokens; on the demo's tool calls that keeps the acceptance
of indexing every size from 2 to 12 in both at a fifth of the indexing. Where nothing
matches, nothing is proposed and the step costs what a plain decode costs. Each index maps
an n-gram to where it last ended and grows by the tokens appended since the previous step:
a proposal is a few dictionary lookups, not a scan.
"""

from __future__ import annotations

from engine.sequence import Sequence
from engine.speculative.base import Draft, Drafter


class NgramIndex:
    """Where each n-gram of a token list, for n in `sizes`, last ended."""

    def __init__(self, sizes: tuple[int, ...]):
        self.sizes = sorted(sizes)
        # n-gram -> the index just past its last occurrence
        self.ends: dict[tuple[int, ...], int] = {}
        self.num_indexed = 0  # n-grams ending before this index are in `ends`

    def extend(self, tokens: list[int], upto: int) -> None:
        """Indexes the n-grams of `tokens` ending at indexes up to `upto`."""
        for n in self.sizes:
            first = max(self.num_indexed, n)  # the first end not indexed yet for this n
            if first > upto:
                continue
            # Each n-gram as a tuple, made in C by zipping shifted slices; later ends win.
            grams = zip(*(tokens[first - n + i : upto - n + i + 1] for i in range(n)))
            self.ends.update(zip(grams, range(first, upto + 1)))
        self.num_indexed = max(self.num_indexed, upto + 1)

    def follow(self, tail: list[int]) -> tuple[int, int] | None:
        """(where, n): the longest indexed n-gram ending `tail`, and where it last ended."""
        for n in reversed(self.sizes):
            end = self.ends.get(tuple(tail[-n:])) if n <= len(tail) else None
            if end is not None:
                return end, n
        return None


OWN_SIZES = (2, 3, 4, 5)  # n-gram sizes of a sequence's own index
HISTORY_SIZES = (2, 3, 4, 5, 8, 12)  # ... and of the shared history's
HISTORY_TOKENS = 65_536  # recent outputs kept for cross-request matches
SEPARATOR = -1  # between outputs in the history: no draft runs across it


class NgramDrafter(Drafter):
    def __init__(
        self, own_sizes: tuple[int, ...] = OWN_SIZES, history_sizes: tuple[int, ...] = HISTORY_SIZES
    ):
        self.own_sizes, self.history_sizes = own_sizes, history_sizes
        self._indexes: dict[str, NgramIndex] = {}
        self._seqs: dict[str, Sequence] = {}  # whose output joins the history when it ends
        self.history: list[int] = []
        self._history_index = NgramIndex(history_sizes)

    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[Draft]:
        drafts = []
        for seq, k in zip(seqs, max_tokens):
            index = self._indexes.get(seq.request_id)
            if index is None:
                index = self._indexes[seq.request_id] = NgramIndex(self.own_sizes)
                self._seqs[seq.request_id] = seq
            tokens = seq.token_ids
            index.extend(tokens, len(tokens) - 1)  # all but the tail itself
            own, shared = index.follow(tokens), self._history_index.follow(tokens)
            if own is not None and (shared is None or own[1] >= shared[1]):
                draft = tokens[own[0] : own[0] + k]
            elif shared is not None:
                draft = self.history[shared[0] : shared[0] + k]
                if SEPARATOR in draft:
                    draft = draft[: draft.index(SEPARATOR)]
            else:
                draft = []
            drafts.append(Draft(draft))
        return drafts

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)
        seq = self._seqs.pop(request_id, None)
        if seq is not None and seq.output_token_ids:
            if len(self.history) > HISTORY_TOKENS:  # start again from the newer half
                self.history = self.history[len(self.history) // 2 :]
                self._history_index = NgramIndex(self.history_sizes)
            # the prompt's tail: what the output's first tokens followed
            start = max(0, seq.num_prompt_tokens - max(self.history_sizes))
            self.history += [*seq.token_ids[start : seq.num_prompt_tokens], *seq.output_token_ids]
            self.history.append(SEPARATOR)
            self._history_index.extend(self.history, len(self.history) - 1)
