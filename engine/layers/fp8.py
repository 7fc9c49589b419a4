"""FP8 block-quantized weights as DeepSeek-V3 and Kimi K2 publish them, kept quantized in memory.

`quantization_config`: {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}.
A quantized Linear's `weight` is float8_e4m3fn [out, in] and its `weight_scale_inv` float32
[ceil(out / 128), ceil(in / 128)]: the true weight is each 128 x 128 block (partial at the
edges) times its scale. Embeddings, norms, routers and lm_head are not quantized.

An `Fp8BlockWeight` goes where a weight tensor goes: sliced for tensor parallelism and joined
(q/k/v, gate/up) along block boundaries, then multiplied by the batch-invariant kernel, which
dequantizes each block inside the matmul (engine/csrc/invariant_linear.cpp) and never makes a
whole dense copy. Slices or joins off the block grid, and weights the engine reshapes (MLA's
absorbed kv_b), are dequantized instead: `dense`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch

BLOCK = 128


@dataclass
class Fp8BlockWeight:
    weight: torch.Tensor  # [out, in] float8_e4m3fn
    scale_inv: torch.Tensor  # [ceil(out / BLOCK), ceil(in / BLOCK)] float32
    dtype: torch.dtype  # the model's: what it dequantizes to and computes in

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def dequantize(self) -> torch.Tensor:
        """The true weight: each block times its scale (in fp32, as transformers does), in the model's dtype."""
        out, cols = self.weight.shape
        scale = self.scale_inv.repeat_interleave(BLOCK, 0)[:out].repeat_interleave(BLOCK, 1)[:, :cols]
        return (self.weight.float() * scale).to(self.dtype)

    def narrow(self, dim: int, start: int, length: int) -> Union["Fp8BlockWeight", None]:
        """Rows or columns [start, start + length) on the block grid; None off it."""
        size = self.weight.shape[dim]
        if start % BLOCK or (length % BLOCK and start + length != size):
            return None
        blocks = -(-length // BLOCK)
        return Fp8BlockWeight(self.weight.narrow(dim, start, length),
                              self.scale_inv.narrow(dim, start // BLOCK, blocks), self.dtype)


Weight = Union[torch.Tensor, Fp8BlockWeight]


def dense(weight: Weight) -> torch.Tensor:
    return weight.dequantize() if isinstance(weight, Fp8BlockWeight) else weight


def cat_rows(parts: list[Weight]) -> Weight:
    """Weights stacked by rows (fused q/k/v, gate/up): still quantized where every part but the
    last ends on a block boundary, else dense."""
    if not any(isinstance(p, Fp8BlockWeight) for p in parts):
        return torch.cat(parts)
    if all(isinstance(p, Fp8BlockWeight) for p in parts) and all(p.shape[0] % BLOCK == 0 for p in parts[:-1]):
        return Fp8BlockWeight(torch.cat([p.weight for p in parts]), torch.cat([p.scale_inv for p in parts]),
                              parts[0].dtype)
    return torch.cat([dense(p) for p in parts])
