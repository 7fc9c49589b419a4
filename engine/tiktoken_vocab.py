"""A tiktoken BPE vocabulary (`tiktoken.model`), read as Kimi K2 / K2.5 ship it, without running
their `tokenization_kimi.py`.

The file's lines are `base64(token bytes) rank`. Special tokens take the ids after the ranks:
RESERVED of them, named by tokenizer_config.json's `added_tokens_decoder` (id -> {"content",
"special"}), the rest `<|reserved_token_ID|>`. Text is split before the merges by `pat_str`
from tokenizer_config.json, else by Kimi's published pattern. Encoding recognises every special
token in the text (a rendered chat template is full of them); decoding skips only those marked
`special` (Kimi's tool-call markup is not, so it reaches the tool-call parser).
"""

from __future__ import annotations

import base64
import os

from engine.errors import CheckpointError

RESERVED = 256 + 2  # as tokenization_kimi.py: num_reserved_special_tokens + 2
KIMI_PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)


def read_ranks(path: str) -> dict[bytes, int]:
    ranks = {}
    try:
        with open(path, "rb") as f:
            for line in f:
                if not line.strip():
                    continue
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"{path}: not a tiktoken BPE file (`base64 rank` lines): {exc}"
        ) from None
    return ranks


class TiktokenVocabulary:
    def __init__(self, folder: str, config: dict):
        import tiktoken

        path = os.path.join(folder, "tiktoken.model")
        ranks = read_ranks(path)
        base = len(ranks)
        added = {int(i): t for i, t in (config.get("added_tokens_decoder") or {}).items()}
        specials = {
            added[i]["content"] if i in added else f"<|reserved_token_{i}|>": i
            for i in range(base, base + RESERVED)
        }
        self.special_ids = frozenset(
            i for i in range(base, base + RESERVED) if added.get(i, {}).get("special", True)
        )
        try:
            self.encoding = tiktoken.Encoding(
                name=os.path.basename(folder),
                pat_str=config.get("pat_str") or KIMI_PATTERN,
                mergeable_ranks=ranks,
                special_tokens=specials,
            )
        except ValueError as exc:
            raise CheckpointError(f"{path}: {exc}") from None
        self._ids = specials

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.encoding.encode(text, allowed_special="all")

    def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        if skip_special_tokens:
            token_ids = [t for t in token_ids if t not in self.special_ids]
        return self.encoding.decode(token_ids)

    def token_to_id(self, token: str) -> int | None:
        if token in self._ids:
            return self._ids[token]
        ids = self.encoding.encode(token, allowed_special="all")
        return ids[0] if len(ids) == 1 else None
