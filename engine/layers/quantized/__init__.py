"""Weights kept in a published checkpoint's quantized form, in memory and in the matmul.

- FP8 block (DeepSeek-V3, Kimi K2): fp8.py.
- FP8 per channel with FP8 activations per token, FBGEMM's (Llama 4 Maverick): fp8_channel.py.
- INT4 groups, compressed-tensors' pack-quantized (Kimi K2-Thinking, K2.5): int4.py.
- MXFP4 blocks and e8m0 scales (gpt-oss's experts): mxfp4.py.
- GGUF's blocks (llama.cpp's Q4_0 ... Q8_0, Q4_K, Q5_K, Q6_K): gguf.py, multiplied by a kernel
  of their own (engine/csrc/gguf_linear.cpp).

A quantized weight goes where a weight tensor goes: sliced for tensor parallelism (`narrow`),
joined by rows for fused q/k/v and gate/up (`cat_rows`), and handed to the batch-invariant
kernel in its own packing (`invariant_form`), which dequantizes inside the matmul and never
makes a whole dense copy. A slice or a join its layout cannot express, and weights the engine
reshapes (MLA's absorbed kv_b), are dequantized instead (`dense`).
"""

from __future__ import annotations

import torch

from engine.layers.quantized.fp8 import Fp8BlockWeight
from engine.layers.quantized.fp8_channel import Fp8ChannelWeight
from engine.layers.quantized.gguf import GgufRows, GgufWeight
from engine.layers.quantized.int4 import Int4GroupWeight
from engine.layers.quantized.mxfp4 import Mxfp4Weight

QuantizedWeight = (
    Fp8BlockWeight | Fp8ChannelWeight | Int4GroupWeight | Mxfp4Weight | GgufWeight | GgufRows
)
Weight = torch.Tensor | QuantizedWeight
QUANTIZED = (Fp8BlockWeight, Fp8ChannelWeight, Int4GroupWeight, Mxfp4Weight, GgufWeight, GgufRows)


def dense(weight: Weight) -> torch.Tensor:
    return weight.dequantize() if isinstance(weight, QUANTIZED) else weight


def narrow(weight: Weight, dim: int, start: int, length: int) -> Weight:
    """Rows or columns [start, start + length): still quantized where the layout allows it."""
    if isinstance(weight, QUANTIZED):
        part = weight.narrow(dim, start, length)
        return (
            part
            if part is not None
            else weight.dequantize().narrow(dim, start, length).contiguous()
        )
    return weight.narrow(dim, start, length)


def cat_rows(parts: list[Weight]) -> Weight:
    """Weights stacked by rows (fused q/k/v, gate/up): still quantized where all parts are of
    one kind and its layout allows the join, else dense."""
    kinds = {type(p) for p in parts}
    if not kinds & set(QUANTIZED):
        return torch.cat(parts)
    if len(kinds) == 1:
        joined = kinds.pop().cat_rows(parts)
        if joined is not None:
            return joined
    return torch.cat([dense(p) for p in parts])


def num_bytes(weight: Weight) -> int:
    """Bytes the weight holds in memory."""
    if isinstance(weight, QUANTIZED):
        return weight.nbytes
    return weight.numel() * weight.element_size()
