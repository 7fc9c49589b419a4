"""A rank's share of the model: its config (heads, KV heads and MLP widths divided by the
tensor-parallel size) and the slice of each weight it reads.

Column-parallel (split by output rows): q, k, v and their biases, gate and up, each
expert's gate and up, the embedding and LM head (by vocabulary, where it divides).
Row-parallel (split by input columns, outputs summed by all-reduce): o_proj, down, each
expert's down. Replicated: norms, routers. Each rank slices the memory-mapped checkpoint
tensor, so it reads only its own rows or columns from disk.

With expert parallelism each rank holds num_experts / ranks whole experts instead: every rank
routes every token (the hidden states are the same on all ranks), runs only its own experts
(the others' routing weights count zero there; the expert ids stay as routed), and the
all-reduce after the MLP adds the ranks' shares (an all-gather dispatch: no token moves).

Pipeline parallelism gives each rank a range of whole layers (`stage_layers`, balanced by
each layer's weights read per token): stage 0 embeds and computes the logits, the last
applies the final norm, and each passes its hidden states to the next.
"""

from __future__ import annotations

import dataclasses

from engine.config import ModelConfig
from engine.errors import CheckpointError


def layer_costs(mc: ModelConfig) -> list[float]:
    """Each layer's weights read per token, in parameters: what a decode step pays for it on a
    bandwidth-bound machine (attention, then the dense MLP or the router and top-k experts)."""
    d, heads_dim = mc.hidden_size, mc.num_heads * mc.head_dim
    attention = d * (2 * heads_dim + 2 * mc.num_kv_heads * mc.head_dim)
    dense = 3 * d * mc.intermediate_size
    costs = []
    for i in range(mc.num_layers):
        moe = mc.moe
        if moe is not None and i in moe.sparse_layers:
            mlp = d * moe.num_experts + 3 * d * moe.intermediate_size * (
                moe.top_k + moe.num_shared_experts
            )
        else:
            mlp = dense
        costs.append(float(attention + mlp))
    return costs


def stage_layers(mc: ModelConfig, stages: int, stage: int) -> range:
    """Pipeline stage `stage`'s layers: consecutive, each cut where the running cost
    (layer_costs) comes nearest the stages' equal shares, so a stage of cheap dense layers
    takes more of them; every stage keeps at least one layer."""
    if mc.num_layers < stages:
        raise CheckpointError(
            f"pipeline_parallel_size {stages} exceeds the model's {mc.num_layers} layers"
        )
    prefix = [0.0]
    for cost in layer_costs(mc):
        prefix.append(prefix[-1] + cost)
    cuts = [0]
    for k in range(1, stages):
        share = prefix[-1] * k / stages
        cuts.append(
            min(
                range(cuts[-1] + 1, mc.num_layers - (stages - k) + 1),
                key=lambda b: abs(prefix[b] - share),
            )
        )
    cuts.append(mc.num_layers)
    return range(cuts[stage], cuts[stage + 1])


def pipeline_config(mc: ModelConfig, stages: int, stage: int) -> ModelConfig:
    """The config of a stage's KV pool: its layers only (the model keeps mc and builds its own)."""
    return dataclasses.replace(mc, num_layers=len(stage_layers(mc, stages, stage)))


def local_config(
    mc: ModelConfig, world: int, rank: int = 0, expert_parallel: bool = False
) -> ModelConfig:
    """`mc` as tensor-parallel rank `rank` of `world` sees it; CheckpointError where the model
    does not divide."""
    if world == 1:
        return mc
    if expert_parallel and mc.moe is None:
        raise CheckpointError("expert parallelism needs a mixture-of-experts model")
    sizes = {"attention heads": mc.num_heads, "MLP width": mc.intermediate_size}
    if mc.mla is None:  # latent attention has no KV heads: every rank keeps the whole latent
        sizes["KV heads"] = mc.num_kv_heads
    if mc.moe is not None:
        sizes["experts" if expert_parallel else "expert width"] = (
            mc.moe.num_experts if expert_parallel else mc.moe.intermediate_size
        )
        if mc.moe.num_shared_experts:
            sizes["shared expert width"] = mc.moe.intermediate_size * mc.moe.num_shared_experts
    uneven = [f"{n} {what}" for what, n in sizes.items() if n % world]
    if uneven:
        raise CheckpointError(
            f"tensor_parallel_size {world} does not divide the model's {', '.join(uneven)}"
        )
    moe = mc.moe
    if moe is not None and expert_parallel:
        count = moe.num_experts // world
        moe = dataclasses.replace(moe, local_experts=(rank * count, count))
    elif moe is not None:
        moe = dataclasses.replace(moe, intermediate_size=moe.intermediate_size // world)
    return dataclasses.replace(
        mc,
        num_heads=mc.num_heads // world,
        num_kv_heads=mc.num_kv_heads // world if mc.mla is None else mc.num_kv_heads,
        intermediate_size=mc.intermediate_size // world,
        moe=moe,
    )
