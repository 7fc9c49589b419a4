"""Which KV blocks are interchangeable: the namespace a block is stored under.

A block is addressed by (namespace, chained block hash). The hash (engine/block_hash.py)
names the tokens; the namespace names everything else that decides the bytes: the model
(an identity the caller derives from its checkpoint), the dtype, the block size and the
block's layout. Blocks of two models, or of one model at two dtypes, can never meet.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

Key = tuple[str, int]  # (namespace, block hash)


def namespace(model_id: str, dtype: str, block_size: int, block_shape: Sequence[int]) -> str:
    """A short stable digest of everything but the tokens that decides a block's bytes.
    `block_shape` is one block's layout, e.g. [layers, 2, block_size, kv_heads, head_dim]."""
    identity = json.dumps([model_id, dtype, block_size, list(block_shape)], separators=(",", ":"))
    return hashlib.blake2b(identity.encode(), digest_size=16).hexdigest()
