"""INT4 weights in groups, as compressed-tensors' `pack-quantized` format publishes them (Kimi
K2-Thinking and K2.5's routed experts: W4A16, symmetric, 32 weights a group).

On disk, per quantized Linear: `weight_packed` int32 [out, in / 8], weight k of a row in bits
4 (k % 8) of word k // 8 as an unsigned nibble (value + 8); `weight_scale` [out, in / group];
`weight_shape` [out, in]. Little-endian, so the int32 words read as bytes are [out, in / 2]
with weight 2j in byte j's low nibble and 2j + 1 in its high one: the layout kept in memory.
The true weight is (nibble - 8) * its group's scale, exact in fp32 for a bf16 scale.
(compressed_tensors.compressors.pack_quantized.helpers is the reference: tests pack with it.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import CheckpointError

OFFSET = 8  # nibble = value + 8


@dataclass
class Int4GroupWeight:
    packed: torch.Tensor  # [out, in / 2] uint8
    scale: torch.Tensor  # [out, in / group] bfloat16 or float32
    dtype: torch.dtype  # the model's: what it dequantizes to and computes in

    @staticmethod
    def from_checkpoint(
        name: str,
        packed: torch.Tensor,
        scale: torch.Tensor,
        shape: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> Int4GroupWeight:
        """From the tensors on disk (still views of the mapped file), checked against each other."""
        out, words = packed.shape if packed.dim() == 2 else (0, 0)
        cols = int(shape[1]) if shape is not None and shape.numel() == 2 else words * 8
        groups = scale.shape[1] if scale.dim() == 2 else 0
        if (
            packed.dtype != torch.int32
            or packed.dim() != 2
            or words != -(-cols // 8)
            or scale.shape[0] != out
            or not groups
            or cols % groups
            or (cols // groups) % 8
        ):
            raise CheckpointError(
                f"weight {name!r}: pack-quantized INT4 is an int32 weight_packed [out, in / 8] with a "
                f"weight_scale [out, in / group] (a group of a multiple of 8 dividing in), not {packed.dtype} "
                f"{tuple(packed.shape)} with {tuple(scale.shape)} for {cols} inputs"
            )
        if scale.dtype not in (torch.bfloat16, torch.float32):
            scale = scale.float()  # fp16 scales: exactly fp32
        return Int4GroupWeight(packed.view(torch.uint8)[:, : cols // 2], scale, dtype)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.packed.shape[0], self.packed.shape[1] * 2))

    @property
    def group(self) -> int:
        return self.shape[1] // self.scale.shape[1]

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scale.numel() * self.scale.element_size()

    def to(self, device: torch.device) -> Int4GroupWeight:
        return Int4GroupWeight(self.packed.to(device), self.scale.to(device), self.dtype)

    def values(self) -> torch.Tensor:
        """[out, in] int8 in [-8, 7]."""
        return (
            torch.stack((self.packed & 0xF, self.packed >> 4), dim=-1)
            .view(self.packed.shape[0], -1)
            .to(torch.int8)
            - OFFSET
        )

    def dequantize(self) -> torch.Tensor:
        """The true weight, (value) * scale in fp32, in the model's dtype."""
        scale = self.scale.float().repeat_interleave(self.group, 1)
        return (self.values().float() * scale).to(self.dtype)

    def narrow(self, dim: int, start: int, length: int) -> Int4GroupWeight | None:
        """Any rows; columns of whole groups (else None)."""
        if dim == 0:
            return Int4GroupWeight(
                self.packed.narrow(0, start, length),
                self.scale.narrow(0, start, length),
                self.dtype,
            )
        group = self.group
        if start % group or length % group:
            return None
        return Int4GroupWeight(
            self.packed.narrow(1, start // 2, length // 2),
            self.scale.narrow(1, start // group, length // group),
            self.dtype,
        )

    @staticmethod
    def cat_rows(parts: list[Int4GroupWeight]) -> Int4GroupWeight | None:
        if len({(p.shape[1], p.group, p.scale.dtype) for p in parts}) != 1:
            return None
        return Int4GroupWeight(
            torch.cat([p.packed for p in parts]),
            torch.cat([p.scale for p in parts]),
            parts[0].dtype,
        )

    def invariant_form(self, pack) -> dict:
        """The batch-invariant kernel's operands: records [blocks of 16 rows, groups, the group's
        words then its 16 scales] packed in one pass by the CPU ops (engine/csrc/
        invariant_linear.cpp `int4_records`; `pack`, the dense weights' packing, is not needed),
        so the kernel reads a block as one stream; no scales beside."""
        from engine.layers import fused

        records = fused.OPS.int4_records(self.packed.contiguous(), self.scale.contiguous())
        return dict(packed=records, scales=None)
