"""Block hashing and the block manager's bookkeeping, without a model."""

from __future__ import annotations

from engine.block_hash import ROOT_HASH, hash_block, hash_blocks
from engine.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def make_seq(tokens, name="s") -> Sequence:
    return Sequence(name, tokens, SamplingParams(), seed=0)


def computed_seq(bm: BlockManager, tokens) -> Sequence:
    """A sequence whose every token's KV is computed and committed to the prefix cache."""
    seq = make_seq(tokens)
    bm.allocate(seq, len(tokens))
    seq.num_computed_tokens = len(tokens)
    bm.commit_full_blocks(seq)
    return seq


def test_chained_hash_covers_every_earlier_token():
    a = hash_blocks(list(range(48)), 16)
    b = hash_blocks([99] + list(range(1, 48)), 16)  # first token differs
    assert len(a) == 3 and hash_blocks(list(range(50)), 16) == a  # a partial block has no hash
    assert all(x != y for x, y in zip(a, b))
    assert a[0] == hash_block(ROOT_HASH, list(range(16)))
    assert a[1] == hash_block(a[0], list(range(16, 32)))


def test_shared_prefix_blocks_are_reference_counted():
    bm = BlockManager(num_blocks=8, block_size=4)
    first = make_seq(list(range(10)), "first")
    bm.allocate(first, 10)
    first.num_computed_tokens = 10
    bm.commit_full_blocks(first)

    second = make_seq(list(range(8)) + [70, 71, 72], "second")
    cached = bm.match_prefix(second)
    assert cached == first.block_table[:2]
    bm.allocate(second, 3, cached)
    assert second.num_computed_tokens == 8
    assert [bm.ref_counts[b] for b in cached] == [2, 2]
    assert bm.num_free_blocks == 8 - 3 - 1

    bm.free(first)
    bm.free(second)
    assert bm.num_free_blocks == 8
    assert bm.match_prefix(make_seq(list(range(9)))) == cached  # still cached while free


def test_eviction_takes_least_recently_freed_and_reports_it():
    bm = BlockManager(num_blocks=4, block_size=2)
    seq = computed_seq(bm, [1, 2, 3, 4, 5])
    [stored] = bm.drain_events()
    assert stored.kind == "stored" and len(stored.block_hashes) == 2
    bm.free(seq)  # freed tail first: the prefix block is evicted last
    taken = bm.allocate_blocks(3)
    events = bm.drain_events()
    assert [e.kind for e in events] == ["evicted"]
    assert events[0].block_hashes == (stored.block_hashes[1],)
    assert seq.block_table == [] and len(taken) == 3
    assert bm.match_prefix(make_seq([1, 2, 3, 4, 5])) == [0]


def test_can_allocate_counts_reclaimed_cached_blocks():
    bm = BlockManager(num_blocks=3, block_size=2)
    bm.free(computed_seq(bm, [1, 2, 3, 4, 5]))
    again = make_seq([1, 2, 3, 4, 9, 9, 9])
    cached = bm.match_prefix(again)
    assert len(cached) == 2
    # The two cached blocks sit in the free queue: taking them leaves one block for new tokens.
    assert bm.can_allocate(again, 1, cached)
    assert not bm.can_allocate(again, 3, cached)
