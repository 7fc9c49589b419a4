"""FlashInfer paged attention on CUDA, over the same NHD page layout as the torch backend.

One `BatchPrefillWithPagedKVCacheWrapper` serves prefill chunks and decodes alike (a decode
is a query of length one); it is planned once per step and run in every layer. Imported only
when this backend is chosen, so CPU machines never need flashinfer.
"""

from __future__ import annotations

import flashinfer
import torch

from engine.attention.base import AttentionBackend, AttentionBatch

WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferBackend(AttentionBackend):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if self.latent_v_dim:  # FlashInfer has an MLA wrapper; it is not wired here yet
            raise ValueError(
                "the flashinfer backend does not serve multi-head latent attention yet; use torch"
            )
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")

    def plan(self, batch: AttentionBatch):
        dev, bs = self.device, self.block_size
        qo_indptr = [0]
        kv_indptr = [0]
        kv_indices: list[int] = []
        last_page_len = []
        for qlen, ctx, table in zip(batch.query_lens, batch.context_lens, batch.block_tables):
            num_pages = -(-ctx // bs)
            qo_indptr.append(qo_indptr[-1] + qlen)
            kv_indices.extend(table[:num_pages])
            kv_indptr.append(len(kv_indices))
            last_page_len.append(ctx - (num_pages - 1) * bs)
        as_i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device=dev)  # noqa: E731
        self.wrapper.plan(
            as_i32(qo_indptr),
            as_i32(kv_indptr),
            as_i32(kv_indices),
            as_i32(last_page_len),
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            bs,
            causal=True,
            window_left=-1 if self.sliding_window is None else self.sliding_window - 1,
            sm_scale=self.scale,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )
        return (batch.slot_mapping // bs, batch.slot_mapping % bs)

    def forward(self, q, k, v, kv_layer, meta, sinks=None):
        if sinks is not None:
            raise NotImplementedError(
                "the flashinfer attention backend takes no attention sinks (gpt-oss): "
                "--attention-backend torch"
            )
        slot_blocks, slot_offsets = meta
        kv_layer[slot_blocks, 0, slot_offsets] = k
        kv_layer[slot_blocks, 1, slot_offsets] = v
        return self.wrapper.run(q, kv_layer)
