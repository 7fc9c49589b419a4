"""Weights kept in a GGUF file's quantized blocks (llama.cpp's ggml types).

A quantized GGUF tensor [out, in] is `out` rows of blocks, each row `in / block` blocks of the
type's bytes: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 over 32 weights, the K-quants Q4_K, Q5_K and Q6_K over
super-blocks of 256. They stay as the file stores them (views of its memory mapping until a row
permutation copies them; joined weights stay apart: GgufRows) and the CPU multiplies them in
engine/csrc/gguf_linear.cpp, which dequantizes each weight as gguf-py's reference `dequantize` does.
Other types (Q2_K, Q3_K, the IQ types) are widened once at load (engine/gguf/reader.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# ggml type number -> (weights a block, bytes a block): the types the kernel multiplies.
KEPT_TYPES = {
    2: (32, 18),  # Q4_0
    3: (32, 20),  # Q4_1
    6: (32, 22),  # Q5_0
    7: (32, 24),  # Q5_1
    8: (32, 34),  # Q8_0
    12: (256, 144),  # Q4_K
    13: (256, 176),  # Q5_K
    14: (256, 210),  # Q6_K
}


@dataclass
class GgufWeight:
    raw: torch.Tensor  # [out, in / block * bytes] uint8: each row its blocks
    kind: int  # the ggml type number (KEPT_TYPES)
    cols: int  # in
    dtype: torch.dtype  # the model's: what it dequantizes to and computes in

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.raw.shape[0], self.cols))

    @property
    def block(self) -> int:
        return KEPT_TYPES[self.kind][0]

    @property
    def device(self) -> torch.device:
        return self.raw.device

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def to(self, device: torch.device) -> GgufWeight:
        return GgufWeight(self.raw.to(device), self.kind, self.cols, self.dtype)

    def dequantize(self) -> torch.Tensor:
        """The true weight [out, in] in the model's dtype: the CPU kernel's own dequantization
        where it is built, else gguf-py's (the same bits)."""
        return dequantize_rows(self.raw, self.kind, self.cols).to(self.raw.device, self.dtype)

    def rows(self, index: torch.Tensor) -> GgufWeight:
        """The rows `index` picks, in its order (still quantized)."""
        return GgufWeight(self.raw.index_select(0, index), self.kind, self.cols, self.dtype)

    def narrow(self, dim: int, start: int, length: int) -> GgufWeight | None:
        """Any rows; columns of whole blocks (else None)."""
        if dim == 0:
            return GgufWeight(self.raw.narrow(0, start, length), self.kind, self.cols, self.dtype)
        block, nbytes = KEPT_TYPES[self.kind]
        if start % block or length % block:
            return None
        part = self.raw.narrow(1, start // block * nbytes, length // block * nbytes)
        return GgufWeight(part, self.kind, length, self.dtype)

    @staticmethod
    def cat_rows(parts: list[GgufWeight]) -> GgufRows | None:
        if len({p.cols for p in parts}) != 1:
            return None
        return GgufRows(parts)


@dataclass
class GgufRows:
    """GGUF weights stacked by rows (fused q/k/v, gate/up) without joining their bytes: each part
    stays a view of the file, in its own type (a Q4_K_M file mixes Q4_K and Q6_K in one layer),
    and the matmul runs part by part, its outputs side by side. Each output column is one part's
    row, computed as it would be alone, so the result is the same bits as a joined weight's."""

    parts: list[GgufWeight]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(p.shape[0] for p in self.parts), self.parts[0].cols))

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def to(self, device: torch.device) -> GgufRows:
        return GgufRows([p.to(device) for p in self.parts])

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def narrow(self, dim: int, start: int, length: int) -> None:
        return None  # ranks take their rows before the join; a narrow after it goes dense


def dequantize_rows(raw: torch.Tensor, kind: int, cols: int) -> torch.Tensor:
    """fp32 [rows, cols] of GGUF rows of blocks."""
    from engine.layers import fused

    raw = raw.cpu()
    if fused.OPS is not None and hasattr(fused.OPS, "gguf_dequantize"):
        return fused.OPS.gguf_dequantize(
            raw if raw.stride(-1) == 1 else raw.contiguous(), kind, cols
        )
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    dense = dequantize(np.ascontiguousarray(raw.numpy()), GGMLQuantizationType(kind))
    return torch.from_numpy(dense)
