"""cached_tokens by tier: a worker counts as loaded only the store's blocks inside the cached
range, and the gateway's usage splits cached_tokens into local and the store's tiers."""

from engine.requests import Reservation
from services.gateway.protocol import Finish, Usage, Usages
from services.worker.kv_store import Loaded


def test_only_loaded_blocks_inside_the_cached_range_count_by_their_tier():
    loaded = Loaded(
        reservation=Reservation([7, 8, 9]),
        block_hashes=[1, 2, 3],
        tiers=["dram", "dram", "disk"],
        first_block=2,
        block_size=16,
    )
    assert loaded.store_tokens(5 * 16) == {
        "dram": 32,
        "disk": 16,
        "mooncake": 0,
        "mooncake_disk": 0,
    }
    # a partial block is not loaded
    assert loaded.store_tokens(5 * 16 + 7) == {
        "dram": 32,
        "disk": 16,
        "mooncake": 0,
        "mooncake_disk": 0,
    }
    assert loaded.store_tokens(3 * 16) == {"dram": 16, "disk": 0, "mooncake": 0, "mooncake_disk": 0}
    # a local block was evicted first: none used
    assert loaded.store_tokens(16) == {"dram": 0, "disk": 0, "mooncake": 0, "mooncake_disk": 0}


def test_usage_splits_cached_tokens_and_a_prompt_counts_its_least_cached_choice():
    usage = Usage(prompt_tokens=100, cached_tokens=64, store_tokens={"dram": 32, "disk": 16})
    assert usage.cached_tokens_by_tier() == {
        "local": 16,
        "store_dram": 32,
        "store_disk": 16,
        "mooncake_dram": 0,
        "mooncake_disk": 0,
    }
    usages = Usages(n=2)
    usages.add(Finish(index=0, reason="stop", usage=usage))
    usages.add(
        Finish(
            index=1,
            reason="stop",
            usage=Usage(prompt_tokens=100, cached_tokens=96, store_tokens={"dram": 0, "disk": 0}),
        )
    )
    total = usages.total()
    assert (total.prompt_tokens, total.cached_tokens) == (100, 64)
    assert total.cached_tokens_by_tier() == {
        "local": 16,
        "store_dram": 32,
        "store_disk": 16,
        "mooncake_dram": 0,
        "mooncake_disk": 0,
    }


def test_a_mooncake_pools_disk_tier_is_named_apart_from_its_dram():
    loaded = Loaded(
        reservation=Reservation([7, 8, 9]),
        block_hashes=[1, 2, 3],
        tiers=["mooncake", "mooncake_disk", "mooncake_disk"],
        first_block=0,
        block_size=16,
    )
    store_tokens = loaded.store_tokens(3 * 16)
    assert store_tokens == {"dram": 0, "disk": 0, "mooncake": 16, "mooncake_disk": 32}
    usage = Usage(prompt_tokens=64, cached_tokens=48, store_tokens=store_tokens)
    assert usage.cached_tokens_by_tier() == {
        "local": 0,
        "store_dram": 0,
        "store_disk": 0,
        "mooncake_dram": 16,
        "mooncake_disk": 32,
    }
