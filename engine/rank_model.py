"""What one rank of an engine serves, built one way for rank 0 (LLMEngine, in the engine's own
process) and for ranks 1..N-1 (engine/parallel/rank.py): its share of the model's config
(tensor, pipeline and expert parallelism), the KV layout of its heads and layers, its attention
backend, and its share of the weights, loaded."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import create_backend
from engine.attention.base import AttentionBackend
from engine.checkpoint import Checkpoint
from engine.config import EngineConfig, ModelConfig
from engine.errors import CheckpointError
from engine.models import LlamaModel, model_class
from engine.parallel.sharding import local_config, pipeline_config


@dataclass(frozen=True)
class RankLayout:
    shard: tuple[int, int]  # (its tensor-parallel rank, tensor_parallel_size)
    stage: tuple[int, int]  # (its pipeline stage, pipeline_parallel_size)
    local: ModelConfig  # the model as this rank sees it (its heads, MLP slice or experts)
    kv_config: ModelConfig  # its KV pool's: its KV heads, of its stage's layers

    @staticmethod
    def of(config: EngineConfig, mc: ModelConfig, rank: int) -> RankLayout:
        """rank = stage x tensor_parallel_size + its tensor-parallel rank; CheckpointError where
        the model does not divide (checked on rank 0 before any other rank starts)."""
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        shard, stage = (rank % tp, tp), (rank // tp, pp)
        local = local_config(mc, tp, shard[0], config.enable_expert_parallel)
        return RankLayout(shard, stage, local, pipeline_config(local, pp, stage[0]))


def load_rank_model(
    config: EngineConfig,
    mc: ModelConfig,
    layout: RankLayout,
    device: torch.device,
    dtype: torch.dtype,
    weights: dict[str, torch.Tensor] | None = None,
) -> tuple[AttentionBackend, LlamaModel]:
    """The rank's attention backend and its model, its weights read from the checkpoint (or
    given, by name)."""
    backend = create_backend(
        config.attention_backend,
        **layout.local.attention_shape(),
        block_size=config.block_size,
        device=device,
        dtype=dtype,
    )
    lead = layout.shard[0] == 0 and layout.stage[0] == 0  # the one rank that shows progress
    checkpoint = (
        Checkpoint(config.model, mc.weight_prefix, quiet=not lead) if weights is None else None
    )
    try:
        model = model_class(mc.architecture)(
            layout.local,
            checkpoint.weights if checkpoint else weights,
            backend,
            dtype,
            device,
            config.max_model_len or mc.max_position_embeddings,
            shard=layout.shard,
            stage=layout.stage,
        )
    except CheckpointError as exc:  # a weight the config disagrees with: say which file
        if checkpoint is None:
            raise
        raise CheckpointError(f"{checkpoint.source}: {exc}") from exc
    if checkpoint:
        checkpoint.drop_resident_pages()  # repacked weights were copied: don't count them twice
    return backend, model
