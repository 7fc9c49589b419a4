"""The chained block hash: the one identity of a KV block across engine, gateway and KV store.

A sequence's tokens are cut into blocks of `block_size` tokens. Only full blocks are hashed.
Block i's hash covers its own token ids and, through its parent's hash, every token before it:

    hash_0 = H(ROOT_HASH, tokens[0:bs])
    hash_i = H(hash_{i-1}, tokens[i*bs:(i+1)*bs])
    H(parent, ids) = first 8 bytes of BLAKE2b(parent as u64 little-endian || ids as u32 little-endian),
                     read as an unsigned little-endian integer

So two prompts share block i's hash exactly when they share all tokens up to the end of
block i. A cache salt (vLLM's `cache_salt`: a tenant, an API key, a request's own) replaces
ROOT_HASH as block 0's parent, so it enters the first block's hash and, through the chain,
every later one; prompts under different salts share no block anywhere (prefix cache, routing
index, KV events, KV store, transfers), and the empty salt leaves every hash as it was:

    salt_root("") = ROOT_HASH
    salt_root(s)  = first 8 bytes of BLAKE2b(SALT_DOMAIN || s as UTF-8), as above

The hash does not name the model: a store that serves several models keys blocks by
(model, block hash). This module imports nothing but the standard library, so the gateway
(which never imports torch) computes the same hashes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_HASH = 0
SALT_DOMAIN = b"tandem-cache-salt\0"  # a salt's root is never a block's hash of the same bytes


def salt_root(cache_salt: str) -> int:
    """The parent hash of a prompt's first block under `cache_salt` (ROOT_HASH when empty)."""
    if not cache_salt:
        return ROOT_HASH
    digest = hashlib.blake2b(SALT_DOMAIN + cache_salt.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    digest = hashlib.blake2b(
        struct.pack(f"<Q{len(token_ids)}I", parent_hash, *token_ids), digest_size=8
    ).digest()
    return int.from_bytes(digest, "little")


def hash_blocks(
    token_ids: Sequence[int], block_size: int, parent_hash: int = ROOT_HASH
) -> list[int]:
    """Hashes of every full block of `token_ids`, in order (a trailing partial block has none)."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[start : start + block_size])
        hashes.append(parent_hash)
    return hashes


def extend_hashes(
    hashes: list[int],
    token_ids: Sequence[int],
    block_size: int,
    upto_tokens: int,
    root_hash: int = ROOT_HASH,
) -> None:
    """Append to `hashes` the hashes of full blocks within the first `upto_tokens` tokens
    (`root_hash`: the first block's parent, `salt_root` of the sequence's salt)."""
    while (len(hashes) + 1) * block_size <= upto_tokens:
        start = len(hashes) * block_size
        parent = hashes[-1] if hashes else root_hash
        hashes.append(hash_block(parent, token_ids[start : start + block_size]))
