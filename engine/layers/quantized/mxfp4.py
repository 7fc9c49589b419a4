"""MXFP4 weights as gpt-oss publishes its experts (`quantization_config: {"quant_method":
"mxfp4"}`): per projection of a layer's experts, `*_blocks` uint8 [experts, out, in / 32, 16]
(two FP4 e2m1 values a byte, the low nibble first) and `*_scales` uint8 [experts, out, in / 32]
(an e8m0 exponent, 2^(s - 127), for each 32 values along a row).

Row n of an expert is output n (gate_up's rows interleave gate and up); weight k of the row is
nibble k % 2 of byte (k % 32) / 2 of group k // 32, as transformers' integrations/mxfp4.py
`convert_moe_packed_tensors` dequantizes it: FP4_VALUES[nibble] ldexp'd by s - 127, exact in
fp32 and bf16 for every byte (for s = 255, ldexp's overflow). In memory an expert's projection
is its blocks and scales, 4.25 bits a weight, repacked once at load for the batch-invariant
kernel (engine/csrc/invariant_linear.cpp), which expands them inside the matmul.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import CheckpointError

GROUP = 32  # values a scale
# e2m1 by nibble (bit 3 the sign): transformers' FP4_VALUES
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


@dataclass
class Mxfp4Weight:
    blocks: torch.Tensor  # [out, in / 32, 16] uint8
    scales: torch.Tensor  # [out, in / 32] uint8
    dtype: torch.dtype  # the model's: what it dequantizes to and computes in

    @staticmethod
    def from_checkpoint(
        name: str, blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
    ) -> Mxfp4Weight:
        """One expert's (or a stack's) tensors as stored, checked against each other."""
        if (
            blocks.dtype != torch.uint8
            or scales.dtype != torch.uint8
            or blocks.dim() < 3
            or blocks.shape[-1] != 16
            or tuple(blocks.shape[:-1]) != tuple(scales.shape)
        ):
            raise CheckpointError(
                f"weight {name!r}: MXFP4 is uint8 {name}_blocks [..., out, in / 32, 16] with uint8 "
                f"{name}_scales [..., out, in / 32], not {blocks.dtype} {tuple(blocks.shape)} with "
                f"{scales.dtype} {tuple(scales.shape)}"
            )
        return Mxfp4Weight(blocks, scales, dtype)

    def expert(self, e: int) -> Mxfp4Weight:
        """Expert e of a layer's stack [experts, out, in / 32, 16]."""
        return Mxfp4Weight(self.blocks[e], self.scales[e], self.dtype)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.blocks.shape[-3], self.blocks.shape[-2] * GROUP))

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() + self.scales.numel()

    def to(self, device: torch.device) -> Mxfp4Weight:
        return Mxfp4Weight(self.blocks.to(device), self.scales.to(device), self.dtype)

    def dequantize(self) -> torch.Tensor:
        """[out, in] in the model's dtype, as transformers dequantizes: each nibble's value,
        ldexp'd by its scale's exponent."""
        lut = torch.tensor(FP4_VALUES, dtype=self.dtype, device=self.device)
        nibbles = torch.stack((self.blocks & 0x0F, self.blocks >> 4), dim=-1).long()
        values = lut[nibbles].reshape(*self.scales.shape, GROUP)
        exponents = self.scales.to(torch.int32)[..., None] - 127
        return torch.ldexp(values, exponents).to(self.dtype).reshape(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> Mxfp4Weight | None:
        """Any rows; columns of whole groups of 32 (else None)."""
        if dim == 0:
            return Mxfp4Weight(
                self.blocks.narrow(0, start, length),
                self.scales.narrow(0, start, length),
                self.dtype,
            )
        if start % GROUP or length % GROUP:
            return None
        return Mxfp4Weight(
            self.blocks.narrow(1, start // GROUP, length // GROUP),
            self.scales.narrow(1, start // GROUP, length // GROUP),
            self.dtype,
        )

    @staticmethod
    def cat_rows(parts: list[Mxfp4Weight]) -> Mxfp4Weight | None:
        return Mxfp4Weight(
            torch.cat([p.blocks for p in parts]),
            torch.cat([p.scales for p in parts]),
            parts[0].dtype,
        )

    def invariant_form(self, pack) -> dict:
        """The batch-invariant kernel's operands: the bytes [out, in / 2] and the scales [out,
        in / 32] each packed by `pack` into blocks of 16 rows (the dense weights' packing), which
        the kernel tells from FP8's by the scales' dtype."""
        rows = self.blocks.shape[0]
        return dict(
            packed=pack(self.blocks.reshape(rows, -1)), scales=pack(self.scales.contiguous())
        )
