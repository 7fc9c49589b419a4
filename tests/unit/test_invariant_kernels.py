"""The batch-invariant matmul and paged attention (engine/csrc/invariant_*.cpp): a row's output
is the same bits whatever rows are computed with it, and the same bits from the AVX2 and the
portable builds as from this CPU's own, so what an AVX2-only CPU (an AMD EPYC) computes is
checked here too."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.layers import fused
from engine.layers.kernel_choice import invariant_pack
from engine.layers.quantized.fp8 import KERNEL_EXPONENT
from engine.layers.quantized.int4 import Int4GroupWeight

pytestmark = pytest.mark.skipif(fused.OPS is None, reason="the CPU ops are not built")

# (out, in): whole and partial 16-column blocks, k within one 256-chunk and across several.
SHAPES = [(96, 64), (37, 300), (1000, 333), (2965, 256), (130, 1030)]
DTYPES = [torch.float32, torch.bfloat16]


def product(ops, x, packed, bias, out):
    return ops.invariant_linear(x, packed, bias, out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_a_row_is_the_same_bits_in_every_batch(dtype, shape):
    torch.manual_seed(0)
    out, cols = shape
    weight, bias = torch.randn(out, cols).to(dtype), torch.randn(out).to(dtype)
    packed = invariant_pack(weight)
    x = torch.randn(97, cols).to(dtype)
    full = product(fused.OPS, x, packed, bias, out)
    torch.testing.assert_close(
        full.float(),
        F.linear(x.double(), weight.double(), bias.double()).float(),
        rtol=1e-4 if dtype is torch.float32 else 2e-2,
        atol=1e-3 if dtype is torch.float32 else 0.1,
    )
    for start, rows in [(0, 1), (5, 1), (0, 2), (3, 5), (10, 7), (0, 13), (40, 50), (96, 1)]:
        part = product(fused.OPS, x[start : start + rows].contiguous(), packed, bias, out)
        assert torch.equal(part, full[start : start + rows]), (start, rows)
    # A strided view (rows of a wider tensor) gives the same rows too.
    wide = torch.cat([x, torch.randn(97, 3).to(dtype)], dim=1)[:, :cols]
    assert torch.equal(product(fused.OPS, wide, packed, bias, out), full)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_threads_never_change_a_bit(dtype):
    """Work items go to whichever thread frees up first (engine/csrc/ops.h parallel_items), for a
    decode's one row chunk as for a prompt's many: 1, 2 and 3 threads give the same bits."""
    torch.manual_seed(3)
    weight = torch.randn(6144, 256).to(dtype)
    packed = invariant_pack(weight)
    cases = [torch.randn(rows, 256).to(dtype) for rows in (1, 16, 64, 300)]
    attention = attention_case(dtype, 0, False, 64, 6)
    scale = attention[0].shape[2] ** -0.5
    threads = torch.get_num_threads()

    def run():
        products = [product(fused.OPS, x, packed, None, 6144) for x in cases]
        return products + [fused.OPS.paged_attention(*attention, scale)]

    try:
        torch.set_num_threads(1)
        one = run()
        for n in (2, 3):
            torch.set_num_threads(n)
            for i, (a, b) in enumerate(zip(one, run())):
                assert torch.equal(a, b), (n, i)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def other_builds():
    """This source built for AVX2 + FMA (x86-64-v3: an AMD EPYC without AVX-512) and for plain
    x86-64 (scalar std::fma), each under its own op namespace."""
    import platform

    if platform.machine() != "x86_64":
        pytest.skip("x86-64 targets")
    builds = {}
    for march, namespace in [("x86-64-v3", "tandem_x86_64_v3"), ("x86-64", "tandem_x86_64")]:
        torch.ops.load_library(fused.build(march, namespace))
        builds[march] = getattr(torch.ops, namespace)
    return builds


@pytest.mark.parametrize("dtype", DTYPES)
def test_avx2_and_portable_builds_compute_the_same_bits_as_this_cpus(other_builds, dtype):
    torch.manual_seed(1)
    for out, cols in SHAPES[:3]:
        weight, bias = torch.randn(out, cols).to(dtype), torch.randn(out).to(dtype)
        packed = invariant_pack(weight)
        for rows in (1, 6, 29):
            x = torch.randn(rows, cols).to(dtype)
            mine = product(fused.OPS, x, packed, bias, out)
            for march, ops in other_builds.items():
                assert torch.equal(product(ops, x, packed, bias, out), mine), (
                    march,
                    out,
                    cols,
                    rows,
                )


# (window, latent, head dim, query heads); a negative window: chunks of -window (Llama 4)
ATTENTION_CASES = [
    (0, False, 40, 8),
    (20, False, 40, 8),
    (0, True, 40, 8),
    (0, False, 64, 6),
    (20, False, 64, 6),
    (-16, False, 64, 6),
]


def attention_case(dtype, window=0, latent=False, dim=40, heads=8):
    """Two sequences in shuffled pages: q [T, 8, 40] (GQA 4:1; head_dim 40 has a 16-lane tail),
    or a latent (1 kv head, V its first 24 columns); with dim 64 and 6 heads (GQA 3:1), whole
    16-lane vectors, where AVX-512 reduces 16 keys' scores together."""
    torch.manual_seed(2)
    kv_heads = 1 if latent else 2
    pool = torch.randn(12, 2, 16, kv_heads, dim).to(dtype)
    k_pages = pool[:, 0]
    v_pages = k_pages[..., :24] if latent else pool[:, 1]
    tables = torch.tensor([[5, 2, 9, 0, 0], [1, 7, 3, 11, 4]])
    lens = [37, 70]
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
    pos = torch.cat([torch.arange(n) for n in lens])
    q = torch.randn(len(seq), heads, dim).to(dtype)
    return q, k_pages, v_pages, tables, seq, pos, window


def first_key(pos: int, window: int) -> int:
    """The first key a token at pos sees: under a sliding window, or in its chunk (window < 0)."""
    if window < 0:
        return pos - pos % -window
    return max(0, pos - window + 1) if window else 0


def reference_attention(q, k_pages, v_pages, tables, seq, pos, window):
    out = []
    for t in range(len(seq)):
        keys = torch.arange(first_key(int(pos[t]), window), pos[t] + 1)
        blocks = tables[seq[t], keys // 16]
        k = k_pages[blocks, keys % 16].double()  # [L, kv_heads, dim]
        v = v_pages[blocks, keys % 16].double()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("hd,lhd->hl", q[t].double(), k) * q.shape[2] ** -0.5
        out.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), v))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,latent,dim,heads", ATTENTION_CASES)
def test_attention_is_exact_enough_and_a_token_is_the_same_bits_alone(
    dtype, window, latent, dim, heads
):
    q, k_pages, v_pages, tables, seq, pos, window = attention_case(
        dtype, window, latent, dim, heads
    )
    scale = q.shape[2] ** -0.5
    every = fused.OPS.paged_attention(q, k_pages, v_pages, tables, seq, pos, window, scale)
    expected = reference_attention(q, k_pages, v_pages, tables, seq, pos, window).float()
    tol = 1e-5 if dtype is torch.float32 else 2e-2
    torch.testing.assert_close(every.float(), expected, rtol=tol, atol=tol)
    for rows in [[t] for t in range(len(seq))] + [[100, 3], list(range(50, 60))]:
        picked = torch.tensor(rows)
        alone = fused.OPS.paged_attention(
            q[picked], k_pages, v_pages, tables, seq[picked], pos[picked], window, scale
        )
        assert torch.equal(alone, every[picked]), rows
    # q as the model passes it: a view of q, k and v together (rows and heads strided)
    qkv = torch.cat([q, torch.randn(q.shape[0], 3, q.shape[2]).to(dtype)], dim=1)
    strided = qkv[:, : q.shape[1]]
    assert not strided.is_contiguous()
    viewed = fused.OPS.paged_attention(strided, k_pages, v_pages, tables, seq, pos, window, scale)
    assert torch.equal(viewed, every)


@pytest.mark.parametrize("dtype,sinks", [(torch.float32, False), (torch.bfloat16, True)])
def test_a_long_prompts_tiles_grouped_over_key_blocks_are_each_tokens_own_bits(dtype, sinks):
    """Past 4 MB of keys and values a tile (2,048 keys of 2 x 256 fp32 or 2 x 512 bf16 dims), a
    prompt's tiles go in groups over blocks of keys: each row's bits stay those of its token alone,
    up to the group's last, partial tile (2,202 tokens: 2 of the last tile's 4)."""
    torch.manual_seed(3)
    dim, length = (256, 2202) if dtype is torch.float32 else (512, 2202)
    blocks = length // 16 + 1
    k_pages = torch.randn(blocks, 16, 1, dim).to(dtype)
    v_pages = torch.randn(blocks, 16, 1, dim).to(dtype)
    tables = torch.randperm(blocks).view(1, -1)
    seq, pos = torch.zeros(length, dtype=torch.long), torch.arange(length)
    q = torch.randn(length, 4, dim).to(dtype)
    sink = torch.randn(4) if sinks else None
    scale = dim**-0.5
    every = fused.OPS.paged_attention(q, k_pages, v_pages, tables, seq, pos, 0, scale, sink)
    rows = [0, 2047, 2048, 2100, 2199, 2200, 2201]
    alone = [
        fused.OPS.paged_attention(
            q[t : t + 1], k_pages, v_pages, tables, seq[t : t + 1], pos[t : t + 1], 0, scale, sink
        )
        for t in rows
    ]
    assert torch.equal(torch.cat(alone), every[rows])
    if not sinks:
        expected = reference_attention(q[rows], k_pages, v_pages, tables, seq[rows], pos[rows], 0)
        torch.testing.assert_close(every[rows].double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_avx2_and_portable_builds_attend_to_the_same_bits(other_builds, dtype):
    for case in ATTENTION_CASES:
        q, k_pages, v_pages, tables, seq, pos, window = attention_case(dtype, *case)
        args = (q, k_pages, v_pages, tables, seq, pos, window, q.shape[2] ** -0.5)
        mine = fused.OPS.paged_attention(*args)
        for march, ops in other_builds.items():
            assert torch.equal(ops.paged_attention(*args), mine), (march, case)


@pytest.mark.parametrize("window", [0, 20])
def test_bf16_attention_with_tiny_values_is_the_same_bits_in_every_build(other_builds, window):
    """bf16 attention sums q.k and p.v in bf16 pairs (AVX512-BF16's dot product where the CPU
    has it, which flushes subnormal products and sums): q, keys, values and p below 2^-55 count
    as zero on every build. Heads whose every q.k would be subnormal, subnormal and tiny values
    among normal ones, through the per-row path and the prompt tiles (the second
    sequence's 70 tokens), odd and even first keys (the window of 20)."""
    q, k_pages, v_pages, tables, seq, pos, window = attention_case(
        torch.bfloat16, window, dim=64, heads=6
    )
    q, k_pages, v_pages = q.clone(), k_pages.clone(), v_pages.clone()
    q[:, 0] *= 2.0**-64  # with keys of head 0 below: q.k 2^-128 and less
    k_pages[..., 0, :] *= 2.0**-64
    v_pages[..., 1, :] *= 2.0**-50  # some of them below 2^-55
    q[::3, 3, :6] = torch.tensor([1e-39, -3e-38, 2.0**-54, -(2.0**-56), 1e-30, 5.0])
    k_pages[::2, :, 1, 10:14] = torch.tensor([1e-39, 2.0**-56, -(2.0**-54), 3.0])
    v_pages[1::2, :, 0, 5:8] = torch.tensor([-1e-39, 2.0**-55, 2.0**-56])
    q, k_pages, v_pages = (t.to(torch.bfloat16) for t in (q, k_pages, v_pages))
    args = (q, k_pages, v_pages, tables, seq, pos, window, q.shape[2] ** -0.5)
    mine = fused.OPS.paged_attention(*args)
    assert mine.isfinite().all()
    tiny = 2.0**-55
    kept = [t.double().masked_fill(t.double().abs() < tiny, 0) for t in (q, k_pages, v_pages)]
    expected = reference_attention(*kept, tables, seq, pos, window)
    head_scale = torch.tensor([1.0] * 3 + [2.0**50] * 3).view(1, -1, 1)  # heads 3-5 on kv head 1
    torch.testing.assert_close(
        mine.double() * head_scale, expected * head_scale, rtol=2e-2, atol=2e-2
    )
    for march, ops in other_builds.items():
        assert torch.equal(ops.paged_attention(*args), mine), march
    for t in [0, 36, 37, 80, 106]:  # each token alone: the same bits
        alone = fused.OPS.paged_attention(
            q[t : t + 1], k_pages, v_pages, tables, seq[t : t + 1], pos[t : t + 1], window, args[-1]
        )
        assert torch.equal(alone, mine[t : t + 1]), t


def test_bf16_pairs_with_tiny_values_are_the_same_bits_in_every_build(other_builds):
    """bf16 sums pairs of k in AVX512-BF16's dot product where the CPU has it, which flushes
    subnormal products and sums; weights and activations below 2^-55 are zero on every build, so
    the FMA builds compute the same bits. An odd in (the last pair padded) and rows whose products
    would all be subnormal."""
    torch.manual_seed(6)
    out, cols = 70, 301
    weight = torch.randn(out, cols)
    weight[:8] *= 2.0**-64  # products with row 1: 2^-128, below fp32's smallest normal
    weight[8, :5] = torch.tensor([2.0**-54, -(2.0**-56), 1e-30, -1e-39, 3.0])
    weight = weight.to(torch.bfloat16)
    x = torch.randn(12, cols)
    x[1] *= 2.0**-64
    x[2] *= 1e-20
    x[3, :4] = torch.tensor([1e-39, -3e-38, 2.0**-54, -(2.0**-56)])
    x = x.to(torch.bfloat16)
    packed = invariant_pack(weight)
    mine = product(fused.OPS, x, packed, None, out)
    tiny = 2.0**-55
    kept_w = weight.double().masked_fill(weight.double().abs() < tiny, 0)
    kept_x = x.double().masked_fill(x.double().abs() < tiny, 0)
    torch.testing.assert_close(mine.double(), kept_x @ kept_w.T, rtol=2e-2, atol=0.1)
    assert not mine[1, 8:].any() and mine[1, 8:].numel()  # |x| < 2^-55: zero
    for march, ops in other_builds.items():
        assert torch.equal(product(ops, x, packed, None, out), mine), march
    for start, rows in [(0, 1), (1, 1), (3, 5)]:
        part = product(fused.OPS, x[start : start + rows].contiguous(), packed, None, out)
        assert torch.equal(part, mine[start : start + rows]), (start, rows)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_blocks_are_the_same_bits_alone_and_in_every_build(other_builds, dtype):
    torch.manual_seed(3)
    out, cols = 300, 200  # 3 x 2 blocks of 128, partial at both edges
    scales = torch.rand(3, 2) * 0.01 + 1e-3
    full = scales.repeat_interleave(128, 0)[:out].repeat_interleave(128, 1)[:, :cols]
    weight = (torch.randn(out, cols) / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    packed, prescaled = invariant_pack(weight.view(torch.uint8)), scales * KERNEL_EXPONENT
    x = torch.randn(9, cols).to(dtype)
    mine = fused.OPS.invariant_linear(x, packed, None, out, prescaled)
    expected = x.double() @ (weight.double() * full.double()).T
    torch.testing.assert_close(
        mine.double(),
        expected,
        rtol=1e-4 if dtype is torch.float32 else 2e-2,
        atol=1e-4 if dtype is torch.float32 else 0.2,
    )
    assert torch.equal(
        fused.OPS.invariant_linear(x[4:5].contiguous(), packed, None, out, prescaled), mine[4:5]
    )
    for march, ops in other_builds.items():
        assert torch.equal(ops.invariant_linear(x, packed, None, out, prescaled), mine), march


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "out, cols, group, scale_dtype",
    [
        (300, 256, 32, torch.bfloat16),
        (37, 544, 32, torch.float32),
        (70, 1024, 128, torch.bfloat16),
        (20, 48, 48, torch.bfloat16),
    ],
)
def test_int4_groups_are_exact_enough_and_the_same_bits_alone_and_in_every_build(
    other_builds, dtype, out, cols, group, scale_dtype
):
    """Packed by compressed-tensors itself (the published layout); k within one pass and across
    several, groups dividing the 256-k pass and not."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    torch.manual_seed(4)
    values = torch.randint(-8, 8, (out, cols), dtype=torch.int8)
    scale = (torch.rand(out, cols // group) * 0.02 + 1e-3).to(scale_dtype)
    weight = Int4GroupWeight.from_checkpoint(
        "w", pack_to_int32(values, 4), scale, torch.tensor([out, cols]), dtype
    )
    assert torch.equal(weight.values(), values)
    form = weight.invariant_form(invariant_pack)
    x = torch.randn(23, cols)
    # Activations near and below fp32's smallest normal (where AVX512-BF16's dot product, which
    # this CPU's build may sum bf16 pairs with, flushes what the other builds' FMAs keep).
    x[1] *= 2e-38
    x[2] *= 1e-29
    x[3, :4] = torch.tensor([1e-39, -3e-38, 1e-35, -5e-31])
    x = x.to(dtype)
    mine = fused.OPS.invariant_linear(x, form["packed"], None, out, form["scales"])
    expected = x.double() @ (values.double() * scale.double().repeat_interleave(group, 1)).T
    torch.testing.assert_close(
        mine.double(),
        expected,
        rtol=1e-5 if dtype is torch.float32 else 2e-2,
        atol=1e-4 if dtype is torch.float32 else 0.05,
    )
    for start, rows in [(0, 1), (1, 1), (2, 1), (4, 1), (3, 5), (10, 13)]:
        part = fused.OPS.invariant_linear(
            x[start : start + rows].contiguous(), form["packed"], None, out, form["scales"]
        )
        assert torch.equal(part, mine[start : start + rows]), (start, rows)
    for march, ops in other_builds.items():
        assert torch.equal(
            ops.invariant_linear(x, form["packed"], None, out, form["scales"]), mine
        ), march


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_head_in_one_call_is_the_same_bits_as_a_call_a_head(other_builds, dtype):
    """Multi-head latent attention's absorbed projections (PerHeadLinear): x [T, heads, in] as a
    strided view, as the model slices it."""
    torch.manual_seed(5)
    heads, out, cols = 5, 40, 70
    weights = torch.randn(heads, out, cols).to(dtype)
    packed = torch.stack([invariant_pack(w) for w in weights])
    x = torch.randn(9, heads, cols + 6).to(dtype)[..., 3 : cols + 3]
    mine = fused.OPS.invariant_linear_heads(x, packed, out)
    for h in range(heads):
        alone = fused.OPS.invariant_linear(x[:, h].contiguous(), packed[h], None, out)
        assert torch.equal(mine[:, h], alone), h
    assert torch.equal(fused.OPS.invariant_linear_heads(x[2:3], packed, out), mine[2:3])
    for march, ops in other_builds.items():
        assert torch.equal(ops.invariant_linear_heads(x, packed, out), mine), march


@pytest.mark.parametrize("dtype", DTYPES)
def test_groups_of_rows_each_on_its_own_weight_are_the_same_bits_as_a_call_each(
    other_builds, dtype
):
    """A mixture of experts' chosen experts in one call (invariant_linear_grouped), dense, FP8 and
    INT4, groups of 0, 1 and many rows."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from engine.layers.quantized.fp8 import Fp8BlockWeight

    torch.manual_seed(6)
    out, cols, sizes = 48, 256, [3, 0, 1, 9]
    x = torch.randn(sum(sizes), cols).to(dtype)
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    for kind in ("dense", "fp8", "int4"):
        forms = []
        for _ in sizes:
            if kind == "dense":
                forms.append(
                    {"packed": invariant_pack(torch.randn(out, cols).to(dtype)), "scales": None}
                )
            elif kind == "fp8":
                scales = torch.rand(1, 2) * 0.01 + 1e-3
                weight = (torch.randn(out, cols) * 30).clamp(-448, 448).to(torch.float8_e4m3fn)
                forms.append(Fp8BlockWeight(weight, scales, dtype).invariant_form(invariant_pack))
            else:
                values = torch.randint(-8, 8, (out, cols), dtype=torch.int8)
                weight = Int4GroupWeight.from_checkpoint(
                    "w",
                    pack_to_int32(values, 4),
                    (torch.rand(out, cols // 32) * 0.02).bfloat16(),
                    None,
                    dtype,
                )
                forms.append(weight.invariant_form(invariant_pack))
        mine = fused.OPS.invariant_linear_grouped(
            x, [f["packed"] for f in forms], [f["scales"] for f in forms], offsets, out
        )
        for f, a, b in zip(forms, offsets, offsets[1:]):
            alone = fused.OPS.invariant_linear(
                x[a:b].contiguous(), f["packed"], None, out, f["scales"]
            )
            assert torch.equal(mine[a:b], alone), (kind, a, b)
        for march, ops in other_builds.items():
            theirs = ops.invariant_linear_grouped(
                x, [f["packed"] for f in forms], [f["scales"] for f in forms], offsets, out
            )
            assert torch.equal(theirs, mine), (kind, march)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_is_exact_enough_and_a_rows_bits_are_its_own_in_every_build(
    other_builds, dtype
):
    torch.manual_seed(4)
    for rows, width in [(9, 768), (5, 37)]:  # whole vectors, and a tail past them
        gate_up = (torch.randn(rows, 2 * width) * 4).to(dtype)
        gate_up[0, :3] = torch.tensor([-100.0, 100.0, 0.0])  # exp's range ends and zero
        mine = fused.OPS.silu_and_mul(gate_up)
        gate, up = gate_up.double().chunk(2, dim=-1)
        tolerance = 2e-6 if dtype is torch.float32 else 8e-3
        torch.testing.assert_close(mine.double(), F.silu(gate) * up, rtol=tolerance, atol=1e-6)
        for r in range(rows):
            assert torch.equal(
                fused.OPS.silu_and_mul(gate_up[r : r + 1].contiguous()), mine[r : r + 1]
            )
        for march, ops in other_builds.items():
            assert torch.equal(ops.silu_and_mul(gate_up), mine), (march, rows, width)


def gate_up_weights(dtype, width, cols):
    """A gate_up weight [2 * width, cols] in each form the kernel takes: (kind, packed, scales)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    dense = (torch.randn(2 * width, cols) / 8).to(dtype)
    yield "dense", invariant_pack(dense), None
    scales = torch.rand(2 * width // 128, (cols + 127) // 128) * 0.01 + 1e-3
    full = scales.repeat_interleave(128, 0).repeat_interleave(128, 1)[:, :cols]
    fp8 = (torch.randn(2 * width, cols) / full).clamp(-448, 448).to(torch.float8_e4m3fn)
    yield "fp8", invariant_pack(fp8.view(torch.uint8)), scales * KERNEL_EXPONENT
    values = torch.randint(-8, 8, (2 * width, cols), dtype=torch.int8)
    group_scales = (torch.rand(2 * width, cols // 32) * 0.02 + 1e-3).to(torch.bfloat16)
    int4 = Int4GroupWeight.from_checkpoint(
        "w", pack_to_int32(values, 4), group_scales, torch.tensor([2 * width, cols]), dtype
    ).invariant_form(invariant_pack)
    yield "int4", int4["packed"], int4["scales"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_gate_up_and_silu_in_one_pass_are_the_bits_of_the_two_ops(other_builds, dtype):
    """invariant_linear_silu (GatedMLP's one pass) against silu_and_mul of invariant_linear: every
    weight kind, the one- and two-row tiles, several row chunks, and every build."""
    torch.manual_seed(6)
    for width, cols in [(128, 96), (384, 288)]:
        x = (torch.randn(100, cols) * 2).to(dtype)
        for kind, packed, scales in gate_up_weights(dtype, width, cols):
            for rows in (1, 2, 7, 100):
                part = x[:rows].contiguous()
                two_ops = fused.OPS.silu_and_mul(
                    fused.OPS.invariant_linear(part, packed, None, 2 * width, scales)
                )
                for march, ops in [("native", fused.OPS), *other_builds.items()]:
                    one = ops.invariant_linear_silu(part, packed, width, scales)
                    assert torch.equal(one, two_ops), (kind, width, rows, march)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_weight_past_the_l2_cache_gives_the_same_bits_panel_by_panel(other_builds, dtype):
    """A prompt's rows on a weight too large for a core's L2 take the items panel by panel
    (engine/csrc/invariant_linear.cpp's panel_major), a few rows chunk by chunk: each row is the
    same bits either way, alone or with the others, for every weight kind and build."""
    torch.manual_seed(7)
    width, cols = 2048, 512  # gate_up [4096, 512]: 8 MB in fp32, 1 MB in INT4
    x = (torch.randn(150, cols) * 2).to(dtype)  # 4 row chunks, the last of 6 rows
    for kind, packed, scales in gate_up_weights(dtype, width, cols):
        full = fused.OPS.invariant_linear(x, packed, None, 2 * width, scales)
        fused_full = fused.OPS.invariant_linear_silu(x, packed, width, scales)
        assert torch.equal(fused_full, fused.OPS.silu_and_mul(full)), kind
        for start, rows in [(0, 1), (7, 2), (0, 49), (50, 51), (3, 147)]:
            part = x[start : start + rows].contiguous()
            assert torch.equal(
                fused.OPS.invariant_linear(part, packed, None, 2 * width, scales),
                full[start : start + rows],
            ), (kind, start, rows)
            assert torch.equal(
                fused.OPS.invariant_linear_silu(part, packed, width, scales),
                fused_full[start : start + rows],
            ), (kind, start, rows)
        ops = other_builds["x86-64-v3"]
        assert torch.equal(ops.invariant_linear(x, packed, None, 2 * width, scales), full), kind
        assert torch.equal(ops.invariant_linear_silu(x, packed, width, scales), fused_full), kind


def test_sigmoid_is_exact_enough_and_a_values_bits_are_its_own_in_every_build(other_builds):
    torch.manual_seed(5)
    logits = torch.randn(1_001, 37) * 8  # past one thread's share, and a tail
    logits[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    mine = fused.OPS.sigmoid(logits)
    torch.testing.assert_close(mine.double(), logits.double().sigmoid(), rtol=2e-7, atol=1e-30)
    for r in (0, 500, 1_000):  # a row alone: the same bits as where it fell in the batch
        assert torch.equal(fused.OPS.sigmoid(logits[r : r + 1].contiguous()), mine[r : r + 1])
    for march, ops in other_builds.items():
        assert torch.equal(ops.sigmoid(logits), mine), march


def test_log_softmax_is_exact_enough_and_a_rows_bits_are_its_own_in_every_build(other_builds):
    torch.manual_seed(6)
    logits = torch.randn(9, 2_050) * 6  # a vocabulary past whole 16-lane chunks
    logits[0, :3] = torch.tensor([-1e4, 60.0, 0.0])
    mine = fused.OPS.log_softmax(logits)
    torch.testing.assert_close(mine.double(), logits.double().log_softmax(-1), rtol=0, atol=2e-5)
    for r in (0, 4, 8):  # a row alone: the same bits as in the batch
        assert torch.equal(fused.OPS.log_softmax(logits[r : r + 1].contiguous()), mine[r : r + 1])
    for march, ops in other_builds.items():
        assert torch.equal(ops.log_softmax(logits), mine), march
