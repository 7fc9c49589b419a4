"""A parallel engine's KV blocks as one whole engine's: what leaves a worker (disaggregated
prefill's export, blocks offered to the KV store) and what arrives (a decode worker's import,
blocks loaded from the store) has the layout a single process's pool has, so a TP=2 prefill
worker feeds a TP=1 decode worker and the store keeps one copy per block whatever the
parallelism. `ParallelKV` is the block I/O under a parallel engine's KV connector
(engine/kv_connector.py), as the pool itself (`KVCache`) is under a single process's: both
`read_blocks` and `write_blocks` in that layout.

Each rank's pool holds its share: its stage's layers (pipeline) and its KV heads (tensor; a
latent-attention cache is whole on every rank). Rank 0 gathers the shares of blocks with
point-to-point receives (a stage's share has its own number of layers) and scatters them with
sends; the other ranks answer the ReadBlocks and WriteBlocks commands it broadcasts between
steps, on the same channel as the step plans, so a command and a step never interleave.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from engine.kv_cache import KVCache
from engine.parallel import group
from engine.parallel.sharding import local_config, stage_layers


@dataclass
class ReadBlocks:
    """Rank 0 asks every rank for its share of these blocks."""

    block_ids: list[int]


@dataclass
class WriteBlocks:
    """Rank 0 sends every rank its share of these blocks."""

    block_ids: list[int]


@dataclass
class Share:
    layers: slice  # of the model's layers
    heads: slice  # of the model's KV heads (the whole latent with MLA)


def shares(mc: ModelConfig, tensor_parallel: int, pipeline_parallel: int) -> list[Share]:
    """Each rank's share of a block, rank = stage x tensor_parallel + tensor-parallel rank."""
    out = []
    for rank in range(tensor_parallel * pipeline_parallel):
        stage, tp_rank = divmod(rank, tensor_parallel)
        layers = stage_layers(mc, pipeline_parallel, stage)
        heads = local_config(mc, tensor_parallel, tp_rank).kv_layout[1]
        # split, or replicated
        first = tp_rank * heads if heads * tensor_parallel == mc.kv_layout[1] else 0
        out.append(Share(slice(layers.start, layers.stop), slice(first, first + heads)))
    return out


class ParallelKV:
    """Rank 0's side: the whole model's blocks [layers, n, entries, block_size, heads, head_dim]."""

    def __init__(
        self, mc: ModelConfig, tensor_parallel: int, pipeline_parallel: int, kv_cache: KVCache
    ):
        self.kv_cache = kv_cache
        self.shares = shares(mc, tensor_parallel, pipeline_parallel)
        pool = kv_cache.pool
        entries, heads, head_dim = mc.kv_layout
        self.block_shape = (mc.num_layers, entries, pool.shape[3], heads, head_dim)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        group.broadcast(ReadBlocks(block_ids))
        pool = self.kv_cache.pool
        layers, *rest = self.block_shape
        out = torch.empty((layers, len(block_ids), *rest), dtype=pool.dtype, device=pool.device)
        for rank, share in enumerate(self.shares):
            if rank == 0:
                part = self.kv_cache.read_blocks(block_ids)
            else:
                part = group.recv(self._shape(share, len(block_ids)), pool.dtype, pool.device, rank)
            out[share.layers, :, :, :, share.heads] = part
        return out

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        expected = (self.block_shape[0], len(block_ids), *self.block_shape[1:])
        if tuple(data.shape) != expected:
            raise ValueError(f"KV data has shape {tuple(data.shape)}, expected {expected}")
        group.broadcast(WriteBlocks(block_ids))
        pool = self.kv_cache.pool
        for rank, share in enumerate(self.shares):
            part = data[share.layers, :, :, :, share.heads].to(pool.device, pool.dtype).contiguous()
            if rank == 0:
                self.kv_cache.write_blocks(block_ids, part)
            else:
                group.send(part, rank)

    def _shape(self, share: Share, num_blocks: int) -> tuple[int, ...]:
        layers, entries, block_size, _, head_dim = self.block_shape
        return (
            share.layers.stop - share.layers.start,
            num_blocks,
            entries,
            block_size,
            share.heads.stop - share.heads.start,
            head_dim,
        )


def answer(command, kv_cache: KVCache) -> None:
    """Another rank's side of a ReadBlocks or WriteBlocks command."""
    if isinstance(command, ReadBlocks):
        group.send(kv_cache.read_blocks(command.block_ids), 0)
        return
    pool = kv_cache.pool
    shape = (pool.shape[0], len(command.block_ids), *pool.shape[2:])
    kv_cache.write_blocks(command.block_ids, group.recv(shape, pool.dtype, pool.device, 0))
