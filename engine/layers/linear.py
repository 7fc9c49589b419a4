"""Linear layers whose weights are prepared once, at load, for their kernel
(engine/layers/kernel_choice.py): by default the batch-invariant one on its packed weight;
with `TANDEM_KERNELS=measured`, per weight shape and bucket of rows, torch's plain matmul,
oneDNN's on a prepacked weight, or bf16 widened to fp32. A weight keeps at most two forms: as
loaded (often a view of the memory-mapped checkpoint) and one packing. A quantized weight
stays quantized where a kernel dequantizes inside the matmul (`quantized_kernel`).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from engine.layers import fused
from engine.layers.kernel_choice import (
    BUCKET_ROWS,
    bucket_of,
    invariant_kernels,
    invariant_linear,
    invariant_pack,
    kernel_choices,
    onednn_linear,
    onednn_pack,
    widened_linear,
)
from engine.layers.quantized import QUANTIZED, QuantizedWeight, Weight
from engine.layers.quantized.fp8_channel import Fp8ChannelWeight
from engine.layers.quantized.gguf import GgufRows, GgufWeight
from engine.layers.quantized.mxfp4 import Mxfp4Weight

log = logging.getLogger(__name__)


def quantized_kernel(weight: QuantizedWeight) -> str:
    """How a quantized weight is multiplied: on CUDA by Triton's matmul, on CPU by the
    batch-invariant kernel (both read it as published), else (`TANDEM_KERNELS` another) dense.
    GGUF's blocks: on the CPU by their own batch-invariant kernel, elsewhere dense (for now);
    MXFP4's: on the CPU's batch-invariant kernel, elsewhere dense (for now). FP8 per channel:
    the CPU's batch-invariant kernel, elsewhere its stored values widened (for now)."""
    if isinstance(weight, (GgufWeight, GgufRows)):
        usable = weight.device.type == "cpu" and hasattr(fused.OPS, "gguf_linear")
        if usable and invariant_kernels():
            return "gguf"
        _widened_once(weight.device.type)
        return "dense"
    if isinstance(weight, Mxfp4Weight) and weight.device.type != "cpu":
        _widened_once(weight.device.type, "MXFP4")
        return "dense"
    if isinstance(weight, Fp8ChannelWeight) and weight.device.type != "cpu":
        _widened_once(weight.device.type, "FP8 per channel")
        return "dense"
    if weight.device.type == "cuda":
        return "triton"
    return "invariant" if invariant_kernels() else "dense"


@functools.cache
def _widened_once(device: str, kind: str = "GGUF") -> None:
    log.warning(
        "%s's quantized blocks are widened at load on %s (no kernel keeps them there)", kind, device
    )


class Linear:
    """y = x @ weight.T + bias, for x: [T, in] and weight: [out, in]."""

    def __init__(self, weight: Weight, bias: torch.Tensor | None = None):
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.quantized = {}  # a quantized weight's scales, beside its packed bytes
        # FP8 per channel (fp8_channel.py): x quantized per token, both scales applied after
        self.rowwise = weight.rowwise() if isinstance(weight, Fp8ChannelWeight) else None
        if isinstance(weight, QUANTIZED):
            kernel = quantized_kernel(weight)
            if kernel == "gguf":  # the file's blocks, dequantized inside the matmul
                self.kernels = ("gguf",) * len(BUCKET_ROWS)
                self.weight, self.packed = weight, None
                return
            if kernel == "triton":  # the weight as published, read by the kernel
                self.kernels = ("triton",) * len(BUCKET_ROWS)
                self.weight, self.packed = weight, None
                return
            if kernel == "invariant":
                self.quantized = weight.invariant_form(invariant_pack)
                self.packed = self.quantized.pop("packed")
                self.kernels, self.weight = ("invariant",) * len(BUCKET_ROWS), None
                return
            weight = weight.unscaled() if self.rowwise is not None else weight.dequantize()
        choice = kernel_choices().for_weight(weight)
        self.packed = None
        if "invariant" in choice.kernels:
            self.packed = invariant_pack(weight)
        elif "onednn" in choice.kernels:
            self.packed = onednn_pack(weight, choice.pack_hint)
        self.kernels = tuple(
            "plain" if k in ("onednn", "invariant") and self.packed is None else k
            for k in choice.kernels
        )
        # Keep the weight as loaded only where a kernel multiplies by it.
        self.weight = (
            weight if any(k not in ("onednn", "invariant") for k in self.kernels) else None
        )

    @property
    def invariant_only(self) -> bool:
        """Every row count on the batch-invariant kernel, without a bias: what the CPU's one-op
        layers (engine/csrc) take."""
        return (
            self.packed is not None
            and self.bias is None
            and self.rowwise is None
            and set(self.kernels) == {"invariant"}
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.kernels[bucket_of(x.shape[0])]
        if self.rowwise is not None:
            q, x_scale = self.rowwise.quantize(x)  # fp32: the invariant kernel's sums stay fp32
            y = self._product(kernel, q if kernel == "invariant" else q.to(x.dtype), None)
            return self.rowwise.scaled(y, x_scale, x.dtype, self.bias)
        return self._product(kernel, x, self.bias)

    def _product(self, kernel: str, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if kernel == "invariant":
            return invariant_linear(x, self.packed, bias, self.out_features, **self.quantized)
        if kernel == "gguf":
            x = x if x.stride(-1) == 1 else x.contiguous()
            parts = self.weight.parts if isinstance(self.weight, GgufRows) else [self.weight]
            y = fused.OPS.gguf_linear(
                x, [w.raw for w in parts], [w.kind for w in parts], parts[0].cols
            )
            return y if bias is None else y + bias
        if kernel == "triton":
            from engine.triton.quantized_matmul import quantized_matmul  # CUDA's (and tests')

            y = quantized_matmul(x, self.weight)
            return y if bias is None else y + bias
        if kernel == "onednn":
            return onednn_linear(x, self.packed, bias)
        if kernel == "widen":
            return widened_linear(x, self.weight, bias)
        return F.linear(x, self.weight, bias)


def grouped_linear(linears: list[Linear], x: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """linears[g] on rows [offsets[g], offsets[g + 1]) of x: in one call where every one is on the
    batch-invariant kernel (the same bits as a call each), else a call each."""
    if (
        all(
            lin.kernels[0] == "invariant" and lin.bias is None and lin.rowwise is None
            for lin in linears
        )
        and len({lin.out_features for lin in linears}) == 1
        and hasattr(fused.OPS, "invariant_linear_grouped")
    ):
        return fused.OPS.invariant_linear_grouped(
            x if x.stride(-1) == 1 else x.contiguous(),
            [lin.packed for lin in linears],
            [lin.quantized.get("scales") for lin in linears],
            offsets,
            linears[0].out_features,
        )
    return torch.cat([lin(x[a:b]) for lin, a, b in zip(linears, offsets, offsets[1:])])


class PerHeadLinear:
    """y[:, h] = x[:, h] @ weight[h].T for x: [T, heads, in] and weight: [heads, out, in] (multi-head
    latent attention's absorbed projections). Under the batch-invariant kernel every head in one
    call (the same sums as a call a head, without a call's cost 32 times a layer); else one
    Linear a head, so each keeps its kernel."""

    def __init__(self, weight: torch.Tensor):
        self.out_features = weight.shape[1]
        self.packed, self.heads = None, []
        if (
            invariant_kernels()
            and weight.device.type == "cpu"
            and weight.dtype in (torch.float32, torch.bfloat16)
            and hasattr(fused.OPS, "invariant_linear_heads")
        ):
            self.packed = torch.stack([invariant_pack(w) for w in weight])
        else:
            self.heads = [Linear(w) for w in weight]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return fused.OPS.invariant_linear_heads(
                x if x.stride(-1) == 1 else x.contiguous(), self.packed, self.out_features
            )
        return torch.stack([linear(x[:, h]) for h, linear in enumerate(self.heads)], dim=1)
