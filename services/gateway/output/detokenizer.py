"""Incremental detokenization: text deltas as tokens arrive, never a broken UTF-8 character.

Byte-level BPE tokens can end inside a multi-byte character, and some tokenizers change how
a token renders depending on its neighbours. So each step decodes a short window twice: the
tokens of the last emitted delta (for context), and the same plus the unread ones; it emits
the difference, holding text back while it ends in U+FFFD (an incomplete character). The
window moves with the text, so the work per token stays constant.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Decoder,
        skip_special_tokens: bool = True,
        keep: frozenset[int] = frozenset(),
    ):
        """`keep`: special tokens to show anyway (the markup a parser reads: Mistral's [TOOL_CALLS])."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.keep = keep
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # start of the window decoded for context
        self.read_offset = 0  # tokens before this are already emitted as text
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        if self.keep:
            return self.tokenizer.decode(
                ids, skip_special_tokens=self.skip_special_tokens, keep=self.keep
            )
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_token_ids: list[int]) -> str:
        """Append tokens; returns the text they complete (may be empty while a character is split)."""
        self.token_ids.extend(new_token_ids)
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of the stream: whatever is still held back, replacement characters included."""
        full = self._decode(self.token_ids[self.prefix_offset :])
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        self.read_offset = len(self.token_ids)
        delta = full[len(prefix) :]
        self.text += delta
        return delta
