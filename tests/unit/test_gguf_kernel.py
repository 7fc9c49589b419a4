"""GGUF's quantized blocks in the CPU kernel (engine/csrc/gguf_linear.cpp): each kept type's
dequantization is gguf-py's `dequantize`, bit for bit; the matmul sums those very weights (rounded
to bf16 for a bf16 x, in the chains the kernel's header states), and a row's bits do not depend on
its batch, the threads or the build."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize

from engine.layers import fused
from engine.layers.quantized.gguf import KEPT_TYPES, GgufWeight
from tests.gguf_files import HALF_FIELDS, T, random_blocks
from tests.unit.test_invariant_kernels import other_builds  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(
    not hasattr(fused.OPS, "gguf_linear"), reason="the CPU ops are not built"
)
KINDS = [T(k) for k in KEPT_TYPES]


def blocks(kind, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Quantized by gguf-py where it can, else random valid blocks."""
    rng = np.random.default_rng(seed)
    if kind in HALF_FIELDS:
        return random_blocks(rng, rows, cols, kind)
    return quantize((rng.standard_normal((rows, cols)) * 0.1).astype(np.float32), kind)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_each_kept_type_dequantizes_to_gguf_pys_bits(kind):
    raw = blocks(kind, 33, 512)
    reference = dequantize(raw, kind)
    ours = fused.OPS.gguf_dequantize(torch.from_numpy(raw), int(kind), 512).numpy()
    assert np.array_equal(ours.view(np.uint32), reference.view(np.uint32))
    # and the matmul multiplies by exactly those weights: x = I gives them back
    summed = fused.OPS.gguf_linear(torch.eye(512), [torch.from_numpy(raw)], [int(kind)], 512)
    assert torch.equal(summed.T, torch.from_numpy(reference))
    # a bf16 x multiplies them rounded to bf16
    identity = torch.eye(512, dtype=torch.bfloat16)
    summed = fused.OPS.gguf_linear(identity, [torch.from_numpy(raw)], [int(kind)], 512)
    assert torch.equal(summed.T, torch.from_numpy(reference).bfloat16())


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_a_rows_product_is_its_own_in_any_batch_and_close_to_the_exact_one(kind):
    raw = torch.from_numpy(blocks(kind, 70, 512, seed=1))
    x = torch.randn(101, 512)  # two work items of rows, each tile height, a decode's direct sums
    batch = fused.OPS.gguf_linear(x, [raw], [int(kind)], 512)
    for row in (0, 5, 100):
        assert torch.equal(
            fused.OPS.gguf_linear(x[row : row + 1], [raw], [int(kind)], 512), batch[row : row + 1]
        )
    for rows in (slice(3, 9), slice(3, 8), slice(3, 6)):
        assert torch.equal(fused.OPS.gguf_linear(x[rows], [raw], [int(kind)], 512), batch[rows])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(fused.OPS.gguf_linear(x, [raw], [int(kind)], 512), batch)
    finally:
        torch.set_num_threads(threads)
    weight = torch.from_numpy(dequantize(raw.numpy(), kind)).double()
    torch.testing.assert_close(batch.double(), x.double() @ weight.T, rtol=1e-5, atol=1e-4)


def bf16_chains(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The bf16 product as the kernel's header states it, in float64 that holds each step exactly
    before its one rounding to fp32: x [M, K] bf16 (values below 2^-55 zeroed), weight [N, K] the
    dequantized fp32 rounded to bf16; chain j over each 32 k from k0 fuses k0 + 16 + j's product,
    then k0 + j's; the 16 chains added in tree_sum16's tree; the sum rounded to bf16."""
    x = x.double().masked_fill(x.double().abs() < 2.0**-55, 0)
    w = weight.bfloat16().double()
    acc = torch.zeros(x.shape[0], w.shape[0], 16, dtype=torch.float32)
    for k0 in range(0, x.shape[1], 32):
        for k in (k0 + 16, k0):
            acc = (acc.double() + x[:, None, k : k + 16] * w[None, :, k : k + 16]).float()
    s8 = acc[..., :8] + acc[..., 8:]
    s4 = s8[..., :4] + s8[..., 4:]
    return ((s4[..., 0] + s4[..., 2]) + (s4[..., 1] + s4[..., 3])).bfloat16()


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_a_bf16_rows_product_is_the_stated_chains_in_any_batch(kind):
    raw = torch.from_numpy(blocks(kind, 70, 512, seed=3))
    x = torch.randn(250, 512).bfloat16()  # two work items of rows (192 of bf16 with AVX512-BF16)
    x[7, :40] = torch.tensor(
        [1e-20, 2.0**-56, -(2.0**-56), 2.0**-55, 3e-39] * 8
    )  # tiny and subnormal
    batch = fused.OPS.gguf_linear(x, [raw], [int(kind)], 512)
    assert batch.dtype == torch.bfloat16
    assert torch.equal(batch, bf16_chains(x, torch.from_numpy(dequantize(raw.numpy(), kind))))
    for rows in (slice(0, 1), slice(7, 8), slice(3, 9), slice(3, 6), slice(200, 201)):
        assert torch.equal(fused.OPS.gguf_linear(x[rows], [raw], [int(kind)], 512), batch[rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_avx2_and_portable_builds_compute_the_same_bits(other_builds, kind, dtype):  # noqa: F811
    raw = torch.from_numpy(blocks(kind, 21, 256, seed=2))
    x = torch.randn(6, 256).to(dtype)
    ours = fused.OPS.gguf_linear(x, [raw], [int(kind)], 256)
    for ops in other_builds.values():
        assert torch.equal(ops.gguf_linear(x, [raw], [int(kind)], 256), ours)
        assert torch.equal(ops.gguf_linear(x[2:3], [raw], [int(kind)], 256), ours[2:3])  # decode
        assert torch.equal(
            ops.gguf_dequantize(raw, int(kind), 256), fused.OPS.gguf_dequantize(raw, int(kind), 256)
        )


def test_a_gguf_weight_keeps_its_blocks_when_sliced_and_joined():
    raw = torch.from_numpy(blocks(T.Q4_1, 8, 64))
    weight = GgufWeight(raw, int(T.Q4_1), 64, torch.float32)
    dense = weight.dequantize()
    assert torch.equal(weight.narrow(0, 2, 3).dequantize(), dense[2:5])
    assert torch.equal(weight.narrow(1, 32, 32).dequantize(), dense[:, 32:])
    assert weight.narrow(1, 16, 32) is None  # not on a block boundary
    joined = GgufWeight.cat_rows([weight, weight.narrow(0, 0, 2)])
    assert torch.equal(joined.dequantize(), torch.cat([dense, dense[:2]]))
    assert torch.equal(weight.rows(torch.tensor([7, 0])).dequantize(), dense[[7, 0]])


@pytest.mark.parametrize("rows", [1, 5], ids=["decode", "batch"])
def test_joined_weights_of_mixed_types_multiply_part_by_part_as_each_alone(rows):
    """q/k/v of a Q4_K_M file: Q4_K beside Q6_K, joined without copying their bytes."""
    from engine.layers.linear import Linear
    from engine.layers.quantized import cat_rows

    parts = [
        GgufWeight(torch.from_numpy(blocks(kind, rows, 256, seed)), int(kind), 256, torch.float32)
        for seed, (kind, rows) in enumerate([(T.Q4_K, 12), (T.Q6_K, 4), (T.Q8_0, 4)])
    ]
    joined = cat_rows(parts)
    assert joined.nbytes == sum(p.nbytes for p in parts)
    assert all(j.raw.data_ptr() == p.raw.data_ptr() for j, p in zip(joined.parts, parts))
    x = torch.randn(rows, 256)
    alone = torch.cat([Linear(p)(x) for p in parts], dim=-1)
    assert torch.equal(Linear(joined)(x), alone)
    torch.testing.assert_close(alone, x @ joined.dequantize().T, rtol=1e-4, atol=1e-4)


def test_no_rows_give_an_empty_product():
    """A prefill chunk that does not end its prompt samples no row: the LM head gets [0, K]
    (it wrote through a null row pointer before)."""
    raw = torch.from_numpy(blocks(T.Q4_1, 8, 256))
    for dtype in (torch.float32, torch.bfloat16):
        y = fused.OPS.gguf_linear(torch.zeros(0, 256, dtype=dtype), [raw], [int(T.Q4_1)], 256)
        assert y.shape == (0, 8) and y.dtype == dtype
