"""MXFP4 weights as gpt-oss publishes them (engine/layers/quantized/mxfp4.py) in the
batch-invariant matmul (engine/csrc/invariant_linear.cpp): the kernel expands a byte exactly as
transformers' dequantization does, for every byte and scale; its product is the dequantized
weight's, bit for bit, a row's own in any batch and on every build; the weight stays 4-bit."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from engine.layers import fused
from engine.layers.kernel_choice import invariant_pack
from engine.layers.quantized.mxfp4 import Mxfp4Weight
from tests.unit.test_invariant_kernels import other_builds  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(
    not hasattr(fused.OPS, "mxfp4_dequantize"), reason="the CPU ops are not built"
)


def transformers_dequantized(blocks: torch.Tensor, scales: torch.Tensor, dtype) -> torch.Tensor:
    """[out, in]: transformers' dequantization of one expert's blocks (its [in, out], turned)."""
    return convert_moe_packed_tensors(blocks[None], scales[None], dtype=dtype)[0].T


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype is torch.bfloat16 else torch.int32)


def random_weight(out: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bytes with scales of a model's weights (2^-9 .. 2^-1)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (out, cols // 32, 16), dtype=torch.uint8, generator=g)
    return blocks, torch.randint(118, 127, (out, cols // 32), dtype=torch.uint8, generator=g)


def test_every_byte_and_scale_expands_as_transformers_dequantizes_it():
    # row s: scale s (all 256, 255's overflow too) over every byte value
    blocks = torch.arange(256, dtype=torch.uint8).view(16, 16).repeat(256, 1, 1)
    scales = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 16)
    expanded = fused.OPS.mxfp4_dequantize(blocks, scales)
    for dtype in (torch.float32, torch.bfloat16):
        reference = transformers_dequantized(blocks, scales, dtype)
        assert torch.equal(bits(expanded.to(dtype)), bits(reference)), dtype
        assert torch.equal(bits(Mxfp4Weight(blocks, scales, dtype).dequantize()), bits(reference))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_product_is_the_dequantized_weights_bit_for_bit_and_a_rows_own(dtype):
    out, cols = 70, 288  # a partial block of 16 columns; k past one pass of 256
    blocks, scales = random_weight(out, cols, seed=0)
    weight = Mxfp4Weight(blocks, scales, dtype)
    operands = weight.invariant_form(invariant_pack)
    dense = invariant_pack(transformers_dequantized(blocks, scales, dtype).contiguous())
    x = torch.randn(37, cols).to(dtype)
    bias = torch.randn(out).to(dtype)
    mine = fused.OPS.invariant_linear(x, operands["packed"], bias, out, operands["scales"])
    assert torch.equal(mine, fused.OPS.invariant_linear(x, dense, bias, out, None))
    for start, rows in [(0, 1), (5, 1), (3, 6), (30, 7)]:
        part = x[start : start + rows].contiguous()
        alone = fused.OPS.invariant_linear(part, operands["packed"], bias, out, operands["scales"])
        assert torch.equal(alone, mine[start : start + rows]), (start, rows)
    # x = I reads the weights back: the kernel multiplies by exactly those
    eye = fused.OPS.invariant_linear(
        torch.eye(cols), operands["packed"], None, out, operands["scales"]
    )
    assert torch.equal(eye.T, transformers_dequantized(blocks, scales, torch.float32))


def test_avx2_and_portable_builds_compute_the_same_bits(other_builds):  # noqa: F811
    blocks, scales = random_weight(21, 96, seed=1)
    operands = Mxfp4Weight(blocks, scales, torch.float32).invariant_form(invariant_pack)
    x = torch.randn(6, 96)
    mine = fused.OPS.invariant_linear(x, operands["packed"], None, 21, operands["scales"])
    for march, ops in other_builds.items():
        theirs = ops.invariant_linear(x, operands["packed"], None, 21, operands["scales"])
        assert torch.equal(theirs, mine), march
        assert torch.equal(
            ops.mxfp4_dequantize(blocks, scales), fused.OPS.mxfp4_dequantize(blocks, scales)
        )


def test_the_weight_stays_four_bit_when_sliced_joined_and_multiplied(monkeypatch):
    from engine.layers.linear import Linear
    from engine.layers.quantized import cat_rows, narrow

    monkeypatch.setenv("TANDEM_KERNELS", "invariant")
    blocks, scales = random_weight(64, 128, seed=2)
    weight = Mxfp4Weight(blocks, scales, torch.float32)
    dense = weight.dequantize()
    assert torch.equal(narrow(weight, 0, 16, 32).dequantize(), dense[16:48])
    assert torch.equal(narrow(weight, 1, 64, 64).dequantize(), dense[:, 64:])
    assert not isinstance(narrow(weight, 1, 16, 64), Mxfp4Weight)  # not whole groups: dense
    joined = cat_rows([weight, narrow(weight, 0, 0, 16)])
    assert torch.equal(joined.dequantize(), torch.cat([dense, dense[:16]]))
    linear = Linear(weight)
    held = linear.packed.nbytes + linear.quantized["scales"].nbytes
    assert linear.weight is None and held <= 1.15 * weight.nbytes
    x = torch.randn(3, 128)
    torch.testing.assert_close(linear(x), x @ dense.T, rtol=1e-5, atol=1e-5)
