"""A rank's share of the model: its config (heads, KV heads and MLP widths divided by the
tensor-parallel size) and the slice of each weight it reads.

Column-parallel (split by output rows): q, k, v and their biases, gate and up, each
expert's gate and up. Row-parallel (split by input columns, outputs summed by all-reduce):
o_proj, down, each expert's down. Replicated: norms, embeddings, the LM head, routers.
Each rank slices the memory-mapped checkpoint tensor, so it reads only its own rows or
columns from disk.
"""

from __future__ import annotations

import dataclasses

from engine.config import ModelConfig
from engine.errors import CheckpointError


def local_config(mc: ModelConfig, world: int) -> ModelConfig:
    """`mc` as one of `world` ranks sees it; CheckpointError where the model does not divide."""
    if world == 1:
        return mc
    if mc.mla is not None:
        raise CheckpointError("tensor parallelism does not split multi-head latent attention yet")
    sizes = {"attention heads": mc.num_heads, "KV heads": mc.num_kv_heads, "MLP width": mc.intermediate_size}
    if mc.moe is not None:
        sizes["expert width"] = mc.moe.intermediate_size
    uneven = [f"{n} {what}" for what, n in sizes.items() if n % world]
    if uneven:
        raise CheckpointError(f"tensor_parallel_size {world} does not divide the model's {', '.join(uneven)}")
    moe = dataclasses.replace(mc.moe, intermediate_size=mc.moe.intermediate_size // world) if mc.moe else None
    return dataclasses.replace(mc, num_heads=mc.num_heads // world, num_kv_heads=mc.num_kv_heads // world,
                               intermediate_size=mc.intermediate_size // world, moe=moe)
