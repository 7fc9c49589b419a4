"""Cache salts in the chained block hash (engine/block_hash.py) and the engine's prefix cache:
a salt changes every block's hash through the first one only, no salt changes nothing, and a
prefix cached under one salt is never matched under another."""

from __future__ import annotations

from engine.block_hash import ROOT_HASH, extend_hashes, hash_block, hash_blocks, salt_root
from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

TOKENS = [(i * 7) % 500 for i in range(40)]  # two full blocks of 16, and a partial one
# hash_blocks(TOKENS, 16) before cache salts existed: unsalted hashes must stay bit-identical,
# since KV stores, Mooncake pools and peers running the previous release hold blocks under them
UNSALTED = [8279552036310959144, 4052271411743251629]


def test_no_salt_leaves_every_hash_as_it_was():
    assert salt_root("") == ROOT_HASH
    assert hash_blocks(TOKENS, 16) == UNSALTED
    assert hash_blocks(TOKENS, 16, salt_root("")) == UNSALTED
    hashes = []
    extend_hashes(hashes, TOKENS, 16, len(TOKENS))
    assert hashes == UNSALTED


def test_a_salt_changes_every_block_and_only_through_the_first():
    salted = hash_blocks(TOKENS, 16, salt_root("tenant-a"))
    assert all(s != u for s, u in zip(salted, UNSALTED, strict=True))
    # the salt enters block 0 as its parent; later blocks chain on exactly as before
    assert salted[0] == hash_block(salt_root("tenant-a"), TOKENS[:16])
    assert salted[1] == hash_block(salted[0], TOKENS[16:32])
    extended = []
    extend_hashes(extended, TOKENS, 16, len(TOKENS), salt_root("tenant-a"))
    assert extended == salted


def test_salts_are_deterministic_and_distinct():
    assert hash_blocks(TOKENS, 16, salt_root("a")) == hash_blocks(TOKENS, 16, salt_root("a"))
    roots = {salt_root(s) for s in ("a", "b", "a ", "A", "é", "key:1:a:")}
    assert len(roots) == 6 and ROOT_HASH not in roots


def cache_then_match(bm: BlockManager, cached_salt: str, asked_salt: str) -> int:
    """Blocks of TOKENS found in the prefix cache by a sequence under `asked_salt`, after one
    under `cached_salt` computed them."""
    first = Sequence("first", TOKENS, SamplingParams(), seed=0, cache_salt=cached_salt)
    bm.allocate(first, len(TOKENS))
    first.num_computed_tokens = len(TOKENS)
    bm.commit_full_blocks(first)
    bm.free(first)
    second = Sequence("second", TOKENS, SamplingParams(), seed=0, cache_salt=asked_salt)
    return len(bm.match_prefix(second))


def test_the_prefix_cache_matches_only_under_the_same_salt():
    assert cache_then_match(BlockManager(num_blocks=8, block_size=16), "", "") == 2
    assert cache_then_match(BlockManager(num_blocks=8, block_size=16), "a", "a") == 2
    assert cache_then_match(BlockManager(num_blocks=8, block_size=16), "a", "b") == 0
    assert cache_then_match(BlockManager(num_blocks=8, block_size=16), "a", "") == 0
    assert cache_then_match(BlockManager(num_blocks=8, block_size=16), "", "a") == 0


def test_kv_events_carry_the_salted_hashes():
    bm = BlockManager(num_blocks=8, block_size=16)
    cache_then_match(bm, "a", "a")
    [stored] = bm.drain_events()
    assert list(stored.block_hashes) == hash_blocks(TOKENS, 16, salt_root("a"))
