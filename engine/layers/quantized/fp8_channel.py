"""FP8 weights per output channel, multiplied by FP8 activations per token, as FBGEMM computes
them (transformers' integrations/fbgemm_fp8.py; Llama 4 Maverick's FP8 checkpoint).

`quantization_config`: {"quant_method": "fbgemm_fp8", "modules_to_not_convert": [...],
"activation_scale_ub": 1200.0}. A converted Linear's `weight` is float8_e4m3fn [out, in] with a
float32 `weight_scale` [out, 1]; the modules left unconverted stay dense (which ones is read from
the tensors: a float8 weight beside its `weight_scale`). Llama 4's experts keep theirs fused
(engine/models/llama4.py).

The product, as FBGEMM's quantize_fp8_per_row and f8f8bf16_rowwise compute it: each token's row x
is scaled by s_x = max(min(amax(x), ub) / 448, 1 / (448 * 512)), q(x) = fp8(x / s_x) (saturated to
+-448), and y[t, n] = (q(x_t) . W_n) * s_x[t] * s_w[n], the sum in fp32. On the CPU the sum runs
on the batch-invariant kernel's FP8 tile (engine/csrc/invariant_linear.cpp) with unit block
scales, the two scales applied to its fp32 sums; a token's row is its own, in any batch. With
tensor parallelism a row-parallel weight's ranks each hold a slice of x's columns: they share
each token's amax (an all-reduce of the max), so every rank quantizes as one device does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.layers.quantized.fp8 import BLOCK, KERNEL_EXPONENT
from engine.parallel.group import all_reduce_max

FP8_MAX = 448.0
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)  # FBGEMM's least activation scale


@dataclass
class Fp8ChannelWeight:
    weight: torch.Tensor  # [out, in] float8_e4m3fn
    scale: torch.Tensor  # [out] float32
    dtype: torch.dtype  # the model's: what it dequantizes to and computes in
    activation_scale_ub: float | None = None  # the bound on a token's amax
    # x's columns are split across tensor-parallel ranks (a row-parallel slice)
    split_inputs: bool = False

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def nbytes(self) -> int:
        return self.weight.numel() + self.scale.numel() * self.scale.element_size()

    def to(self, device: torch.device) -> Fp8ChannelWeight:
        return replace(self, weight=self.weight.to(device), scale=self.scale.to(device))

    def dequantize(self) -> torch.Tensor:
        """The true weight, each row times its scale (in fp32), in the model's dtype."""
        return (self.weight.float() * self.scale[:, None]).to(self.dtype)

    def narrow(self, dim: int, start: int, length: int) -> Fp8ChannelWeight:
        """Rows (with their scales) or columns: every slice keeps the layout."""
        if dim == 0:
            return replace(
                self,
                weight=self.weight.narrow(0, start, length),
                scale=self.scale.narrow(0, start, length),
            )
        return replace(self, weight=self.weight.narrow(1, start, length), split_inputs=True)

    @staticmethod
    def cat_rows(parts: list[Fp8ChannelWeight]) -> Fp8ChannelWeight | None:
        first = parts[0]
        if any(
            (p.activation_scale_ub, p.split_inputs)
            != (first.activation_scale_ub, first.split_inputs)
            for p in parts
        ):
            return None
        return replace(
            first,
            weight=torch.cat([p.weight for p in parts]),
            scale=torch.cat([p.scale for p in parts]),
        )

    def invariant_form(self, pack) -> dict:
        """The batch-invariant kernel's FP8 operands with unit block scales: the kernel sums
        q(x) . W as stored; `RowwiseFp8` applies the scales after."""
        out, cols = self.weight.shape
        blocks = (-(-out // BLOCK), -(-cols // BLOCK))
        return dict(
            packed=pack(self.weight.view(torch.uint8)),
            scales=torch.full(blocks, KERNEL_EXPONENT, dtype=torch.float32),
        )

    def rowwise(self) -> RowwiseFp8:
        return RowwiseFp8(self.scale.float(), self.activation_scale_ub, self.split_inputs)

    def unscaled(self) -> torch.Tensor:
        """The stored values widened to the model's dtype (exact in bf16 and fp32), for kernels
        that multiply dense weights: the scales are applied after, as on the FP8 kernel."""
        return self.weight.to(self.dtype)


@dataclass
class RowwiseFp8:
    """A Linear's per-token quantization of x and the scales applied to its product."""

    weight_scale: torch.Tensor  # [out] float32
    activation_scale_ub: float | None
    split_inputs: bool

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, in] -> (q(x) as fp32 [T, in], s_x fp32 [T]), as quantize_fp8_per_row."""
        xf = x.float()
        amax = xf.abs().amax(dim=-1) if xf.shape[-1] else xf.new_zeros(xf.shape[0])
        if self.split_inputs:  # the whole row's amax, from every rank's columns
            amax = all_reduce_max(amax)
        if self.activation_scale_ub is not None:
            amax = amax.clamp(max=self.activation_scale_ub)
        scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
        q = (xf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return q.float(), scale

    def scaled(
        self, y: torch.Tensor, x_scale: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """The product of q(x) and the stored weight [T, out] -> y in `dtype` (f8f8bf16_rowwise's
        epilogue: both scales on the fp32 sum, then the bias)."""
        y = (y.float() * x_scale[:, None] * self.weight_scale).to(dtype)
        return y if bias is None else y + bias
