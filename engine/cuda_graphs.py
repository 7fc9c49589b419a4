"""Decode steps replayed from CUDA graphs: one graph per bucket of batch size and pages a
sequence spans, captured the first time a step falls in it.

A decode step of a small model is hundreds of tiny kernels whose launches cost more than their
work; a graph launches them all at once. A graph replays fixed addresses and shapes, so a step
is padded up to its bucket: the step's ids, positions, KV slots, context lengths and block tables
go, in one host-to-device copy, into a staging buffer whose slices every graph reads. Padding
rows decode token 0 at position 0 into a scratch block that the block manager never hands out
(the pool's last), and padding pages point at it too, masked by the context length. Planning
the attention happens inside the graph (TorchBackend.plan_decode), from those tensors alone.

Only steps where every sequence brings one token (decodes, and one-token prompt chunks) and
models with no host reads in their forward (`LlamaModel.capturable`: a mixture of experts does
through its fused experts, engine/triton/fused_moe.py, not through the host's dispatch) replay;
the rest run eagerly as before. Graphs share one memory pool:
they run one at a time, and each step's logits are consumed before the next replay.

Off the GPU (`capture` False: tests on CPU), the same padded step runs eagerly, so everything
but the capture itself is tested without a GPU.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from engine.attention.torch_backend import TorchBackend

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
MIN_PAGES = 8  # the smallest bucket of pages a sequence spans (then powers of two)


def decode_graphs_wanted(config, backend, model, device: torch.device) -> bool:
    """On CUDA, unless `--enforce-eager`, for one process whose attention and model capture."""
    return (
        device.type == "cuda"
        and not config.enforce_eager
        and config.world_size == 1
        and all(isinstance(b, TorchBackend) for b in getattr(backend, "backends", [backend]))
        and model.capturable
    )


class DecodeGraphs:
    def __init__(
        self,
        model,
        kv_pool: torch.Tensor,
        backend: TorchBackend,
        max_batch: int,
        max_model_len: int,
    ):
        """`kv_pool`: every layer's pages, whose last block is the scratch block (one more than
        the engine's block manager has)."""
        self.model, self.kv_pool, self.backend = model, kv_pool, backend
        self.device = kv_pool.device
        self.capture = self.device.type == "cuda"
        self.block_size = backend.block_size
        self.scratch_block = kv_pool.shape[1] - 1
        self.max_batch = next((b for b in BATCH_BUCKETS if b >= max_batch), BATCH_BUCKETS[-1])
        self.max_pages = math.ceil(max_model_len / self.block_size)
        size = self.max_batch * (4 + self.max_pages)
        # Pinned, so the copy to the device is asynchronous; each step's sampling reads its tokens
        # back (a sync) before the next step rewrites this buffer.
        self.host = torch.zeros(size, dtype=torch.long, pin_memory=self.capture)
        self.staged = torch.zeros(size, dtype=torch.long, device=self.device)
        self.graphs: dict[tuple[int, int], tuple[object, torch.Tensor]] = {}
        self.mempool = torch.cuda.graph_pool_handle() if self.capture else None
        self.capture_seconds = 0.0  # spent capturing so far (each bucket's first step pays its own)

    def fits(self, query_lens: list[int], block_tables: list[list[int]]) -> bool:
        return (
            len(query_lens) <= self.max_batch
            and all(n == 1 for n in query_lens)
            and max(len(t) for t in block_tables) <= self.max_pages
        )

    def stage(
        self,
        ids: list[int],
        positions: list[int],
        slots: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
    ) -> tuple[int, int, int]:
        """Copies a step into the staging buffer, padded to its bucket; returns (rows, batch
        bucket, pages bucket) for `replay`."""
        rows = len(ids)
        batch = next(b for b in BATCH_BUCKETS if b >= rows)
        pages = max(len(t) for t in block_tables)
        pages = min(self.max_pages, max(MIN_PAGES, 1 << (pages - 1).bit_length()))
        pad, scratch = batch - rows, self.scratch_block
        values = (
            ids
            + [0] * pad
            + positions
            + [0] * pad
            + slots
            + [scratch * self.block_size] * pad
            + context_lens
            + [1] * pad
        )
        for table in block_tables:
            values += table
            values += [scratch] * (pages - len(table))
        values += [scratch] * (pages * pad)
        count = len(values)
        self.host[:count] = torch.tensor(values, dtype=torch.long)
        self.staged[:count].copy_(self.host[:count], non_blocking=True)
        return rows, batch, pages

    def replay(self, step: tuple[int, int, int]) -> torch.Tensor:
        """fp32 logits [rows, vocab] of a staged step."""
        rows, batch, pages = step
        if not self.capture:
            return self._forward(batch, pages)[:rows]
        if (batch, pages) not in self.graphs:
            self.graphs[batch, pages] = self._capture(batch, pages)
        graph, logits = self.graphs[batch, pages]
        graph.replay()
        return logits[:rows]

    def _forward(self, batch: int, pages: int) -> torch.Tensor:
        """The padded step, read from the staging buffer's slices for this bucket."""
        ids, positions, slots, context_lens = self.staged[: 4 * batch].view(4, batch)
        tables = self.staged[4 * batch : batch * (4 + pages)].view(batch, pages)
        meta = self.backend.plan_decode(slots, tables, context_lens)
        return self.model.compute_logits(self.model.forward(ids, positions, self.kv_pool, meta))

    def _capture(self, batch: int, pages: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        started = time.perf_counter()
        # A first run outside the graph on a side stream (lazy initialisation: cuBLAS handles and
        # workspaces), as torch's docs ask. It computes this very step, so the K/V it writes are
        # the values the replay writes again.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(batch, pages)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a worker's other threads (KV transfers) may use the device meanwhile.
        with torch.cuda.graph(graph, pool=self.mempool, capture_error_mode="thread_local"):
            logits = self._forward(batch, pages)
        self.capture_seconds += time.perf_counter() - started
        log.debug("captured a decode graph for %d sequences over %d pages", batch, pages)
        return graph, logits
