"""A Llama-family decoder layer as one op where it can be (engine/csrc/decoder_layer.cpp): its
four matmuls on GGUF weights kept quantized on the CPU, the batch-invariant attention, no
biases, q/k norms or tensor parallelism. The op calls the kernels the Python layer calls, in
its order, so a token's bits do not depend on which path computed it; it saves the ~20 Python
calls a layer, most of a small model's decode step (SmolLM2-135M: 30 layers)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.attention.invariant_backend import InvariantBackend
from engine.layers import fused
from engine.layers.mlp import GatedMLP
from engine.layers.quantized.gguf import GgufRows


def one_op(layer, ranks: int) -> Callable | None:
    """layer.forward(x, cos_sin, kv_layer, attn_meta) as one op, or None where the layer has
    anything the op does not do. `layer`: a DecoderLayer itself (engine/models/llama.py), not a
    subclass with a forward of its own; `ranks`: its tensor-parallel ranks."""
    mlp = getattr(layer, "mlp", None)
    linears = (
        layer.qkv_proj,
        layer.o_proj,
        getattr(mlp, "gate_up_proj", None),
        getattr(mlp, "down_proj", None),
    )
    if (
        type(mlp) is not GatedMLP
        or type(layer.attn) is not InvariantBackend
        or layer.attn.latent_v_dim
        or layer.qk_norm is not None
        or ranks > 1
        or not hasattr(fused.OPS, "gguf_decoder_layer")
        or any(lin.kernels[0] != "gguf" or lin.bias is not None for lin in linears)
    ):
        return None
    weights = []
    for lin in linears:
        parts = lin.weight.parts if isinstance(lin.weight, GgufRows) else [lin.weight]
        weights += [[p.raw for p in parts], [p.kind for p in parts]]
    cfg, attn = layer.cfg, layer.attn
    shape = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    eps, window = cfg.rms_norm_eps, attn.sliding_window or 0

    def forward(x: torch.Tensor, cos_sin, kv_layer: torch.Tensor, meta) -> torch.Tensor:
        return fused.OPS.gguf_decoder_layer(
            x if x.stride(-1) == 1 else x.contiguous(),
            layer.input_norm,
            layer.post_attn_norm,
            eps,
            *weights,
            *shape,
            *cos_sin,
            kv_layer,
            meta.k_rows,
            meta.v_rows,
            meta.block_tables,
            meta.token_seq,
            meta.token_pos,
            window,
            attn.scale,
        )

    return forward
