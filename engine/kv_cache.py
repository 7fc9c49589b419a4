"""The paged KV pool: one preallocated tensor, sized from a memory budget.

Layout: [num_layers, num_blocks, 2 (k, v), block_size, num_kv_heads, head_dim]; for multi-head
latent attention [..., 1 (the latent and rope part), block_size, 1, kv_lora_rank + rope_dim]
(ModelConfig.kv_layout). One layer's
slice is FlashInfer's NHD paged layout, so the torch and FlashInfer backends share it, and
the whole pool is one allocation that a transport (UCX) can register once.
"""

from __future__ import annotations

import logging
import math
import mmap

import psutil
import torch

from engine.config import EngineConfig, ModelConfig

log = logging.getLogger(__name__)


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    entries, heads, head_dim = model.kv_layout
    return model.num_layers * entries * block_size * heads * head_dim * elem


def num_blocks_for_budget(
    config: EngineConfig, model: ModelConfig, dtype: torch.dtype, device: torch.device
) -> int:
    """How many blocks the KV budget buys: `kv_cache_bytes`, else a fraction of free memory.
    `model`: one rank's share (its heads, its layers). On CPU a parallel engine's ranks share
    the machine's memory, so the budget is the engine's, split between them; on CUDA each rank
    has its own device and budget.

    All of it: the running batch is bounded by `max_num_seqs`, and every block it does not
    hold keeps cached prefixes (the pool's pages are only touched as blocks are used).
    """
    per_block = bytes_per_block(model, config.block_size, dtype)
    if config.kv_cache_bytes is not None:
        budget = config.kv_cache_bytes
    elif device.type == "cuda":
        budget = int(torch.cuda.mem_get_info(device)[0] * config.kv_cache_memory_fraction)
    else:
        budget = int(psutil.virtual_memory().available * config.kv_cache_memory_fraction)
    if device.type != "cuda":
        budget //= config.world_size
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(
            f"KV cache budget of {budget} bytes is below one block ({per_block} bytes)"
        )
    return num_blocks


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros, not empty: attention multiplies masked slots' V by a zero weight, and 0 * NaN
    from uninitialised memory would poison the output. On CPU, an anonymous mapping: the OS
    hands out zero pages lazily as blocks are first written (torch.zeros would touch every
    page up front), and a plain 4 KiB page fault costs ~1 us. Not numpy's zeros: numpy asks
    for transparent huge pages on large arrays, and where the kernel compacts memory for them
    on a fault (defrag "madvise", as on the VMs here) every first write of a page stalled
    ~45 us: 39 ms of a 512-token prefill's KV writes (4.5 ms with plain pages)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    pages = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # the tensor holds a reference to the mapping, which lives as long as it does
    return torch.frombuffer(pages, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


class KVCache:
    def __init__(
        self,
        model: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        entries, heads, head_dim = model.kv_layout  # MLA: one entry, the latent
        shape = (model.num_layers, num_blocks, entries, block_size, heads, head_dim)
        self.pool = _zeros(shape, dtype, device)
        log.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB, %s)",
            num_blocks,
            block_size,
            self.pool.numel() * self.pool.element_size() / 2**20,
            dtype,
        )

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block of every layer: [layers, entries, block_size, kv_heads, head_dim]."""
        return (self.pool.shape[0], *self.pool.shape[2:])

    def layer(self, index: int) -> torch.Tensor:
        # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        return self.pool[index]

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Copy of the given blocks: [num_layers, len(block_ids), 2, block_size, kv_heads, head_dim]."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.pool.device)
        return self.pool.index_select(1, index)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Write blocks exported by `read_blocks` (possibly from another worker) into the pool."""
        expected = (self.pool.shape[0], len(block_ids), *self.pool.shape[2:])
        if tuple(data.shape) != expected:
            raise ValueError(f"KV data has shape {tuple(data.shape)}, expected {expected}")
        index = torch.tensor(block_ids, dtype=torch.long, device=self.pool.device)
        self.pool.index_copy_(1, index, data.to(self.pool.device, self.pool.dtype))
