"""FP8 block-quantized weights as DeepSeek-V3 and Kimi K2 publish them.

`quantization_config`: {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}.
A quantized Linear's `weight` is float8_e4m3fn [out, in] and its `weight_scale_inv` float32
[ceil(out / 128), ceil(in / 128)]: the true weight is each 128 x 128 block (partial at the
edges) times its scale. Embeddings, norms, routers and lm_head are not quantized.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 128
KERNEL_EXPONENT = 2.0**120  # the kernel reads a byte as its value times 2^-120 (engine/csrc/vec.h)


@dataclass
class Fp8BlockWeight:
    weight: torch.Tensor  # [out, in] float8_e4m3fn
    scale_inv: torch.Tensor  # [ceil(out / BLOCK), ceil(in / BLOCK)] float32
    dtype: torch.dtype  # the model's: what it dequantizes to and computes in

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + self.scale_inv.numel() * self.scale_inv.element_size()

    def to(self, device: torch.device) -> Fp8BlockWeight:
        return Fp8BlockWeight(self.weight.to(device), self.scale_inv.to(device), self.dtype)

    def dequantize(self) -> torch.Tensor:
        """The true weight: each block times its scale (in fp32, as transformers does), in the model's dtype."""
        out, cols = self.weight.shape
        scale = self.scale_inv.repeat_interleave(BLOCK, 0)[:out].repeat_interleave(BLOCK, 1)[
            :, :cols
        ]
        return (self.weight.float() * scale).to(self.dtype)

    def narrow(self, dim: int, start: int, length: int) -> Fp8BlockWeight | None:
        """Rows or columns [start, start + length) on the block grid; None off it."""
        size = self.weight.shape[dim]
        if start % BLOCK or (length % BLOCK and start + length != size):
            return None
        blocks = -(-length // BLOCK)
        return Fp8BlockWeight(
            self.weight.narrow(dim, start, length),
            self.scale_inv.narrow(dim, start // BLOCK, blocks),
            self.dtype,
        )

    @staticmethod
    def cat_rows(parts: list[Fp8BlockWeight]) -> Fp8BlockWeight | None:
        """Stacked by rows where every part but the last ends on a block boundary; else None."""
        if any(p.shape[0] % BLOCK for p in parts[:-1]):
            return None
        return Fp8BlockWeight(
            torch.cat([p.weight for p in parts]),
            torch.cat([p.scale_inv for p in parts]),
            parts[0].dtype,
        )

    def invariant_form(self, pack) -> dict:
        """The batch-invariant kernel's operands: the bytes packed by `pack`, the block scales."""
        return dict(
            packed=pack(self.weight.view(torch.uint8)), scales=self.scale_inv * KERNEL_EXPONENT
        )
