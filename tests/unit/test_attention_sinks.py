"""Attention sinks (gpt-oss): each query head's sink logit joins its softmax, in the max and the
sum, and weighs no value. The batch-invariant kernel (engine/csrc/invariant_attention.cpp)
joins them with a token's bits its own and the same on every build; the torch backend joins
them as transformers' eager attention does; both agree over a step of decodes, a short query
and a prompt chunk after cached tokens, with a sliding window and without."""

from __future__ import annotations

import pytest
import torch

from engine.attention import create_backend
from engine.attention.base import AttentionBatch
from engine.layers import fused
from tests.unit.test_invariant_kernels import (  # noqa: F401 (other_builds: a fixture)
    ATTENTION_CASES,
    attention_case,
    first_key,
    other_builds,
)

CASES = [case for case in ATTENTION_CASES if not case[1]]  # latent attention has no sinks
needs_ops = pytest.mark.skipif(fused.OPS is None, reason="the CPU ops are not built")


def reference(q, k_pages, v_pages, tables, seq, pos, window, sinks, scale):
    """[T, heads, dim] in float64: softmax over the visible keys' scores and the sink, sink dropped."""
    out = []
    for t in range(len(seq)):
        keys = torch.arange(first_key(int(pos[t]), window), int(pos[t]) + 1)
        blocks = torch.as_tensor(tables)[seq[t], keys // k_pages.shape[1]]
        k = k_pages[blocks, keys % k_pages.shape[1]].double()  # [L, kv_heads, dim]
        v = v_pages[blocks, keys % k_pages.shape[1]].double()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("hd,lhd->hl", q[t].double(), k) * scale
        probs = torch.cat([scores, sinks.double()[:, None]], dim=1).softmax(-1)[:, :-1]
        out.append(torch.einsum("hl,lhd->hd", probs, v))
    return torch.stack(out)


@needs_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,latent,dim,heads", CASES)
def test_the_kernel_joins_each_heads_sink_and_a_token_keeps_its_bits(
    dtype, window, latent, dim, heads
):
    q, k_pages, v_pages, tables, seq, pos, window = attention_case(
        dtype, window, latent, dim, heads
    )
    scale = dim**-0.5
    sinks = torch.randn(heads) * 3
    every = fused.OPS.paged_attention(q, k_pages, v_pages, tables, seq, pos, window, scale, sinks)
    expected = reference(q, k_pages, v_pages, tables, seq, pos, window, sinks, scale)
    tol = 1e-5 if dtype is torch.float32 else 2e-2
    torch.testing.assert_close(every.double(), expected, rtol=tol, atol=tol)
    plain = fused.OPS.paged_attention(q, k_pages, v_pages, tables, seq, pos, window, scale)
    assert not torch.equal(every, plain)
    # a prompt's tiles (several tokens' rows together) against each token alone
    for rows in [[0], [36], [100, 3], list(range(37, 41)), list(range(50, 60))]:
        picked = torch.tensor(rows)
        alone = fused.OPS.paged_attention(
            q[picked], k_pages, v_pages, tables, seq[picked], pos[picked], window, scale, sinks
        )
        assert torch.equal(alone, every[picked]), rows


@needs_ops
def test_avx2_and_portable_builds_join_the_sinks_to_the_same_bits(other_builds):  # noqa: F811
    for dtype in (torch.float32, torch.bfloat16):
        for case in CASES:
            q, k_pages, v_pages, tables, seq, pos, window = attention_case(dtype, *case)
            args = (q, k_pages, v_pages, tables, seq, pos, window, q.shape[2] ** -0.5)
            sinks = torch.linspace(-2, 4, q.shape[1])
            mine = fused.OPS.paged_attention(*args, sinks)
            for march, ops in other_builds.items():
                assert torch.equal(ops.paged_attention(*args, sinks), mine), (march, case)


@pytest.mark.parametrize("window", [None, 12])
def test_the_backends_join_sinks_over_decodes_a_short_query_and_a_prompt_chunk(window):
    torch.manual_seed(4)
    heads, kv_heads, dim, block = 4, 2, 32, 16
    query_lens, context_lens = [1, 1, 5, 30], [40, 3, 21, 45]  # after cached tokens
    tables = [[3, 0, 7], [8], [5, 1], [2, 6, 4]]
    slots = [
        tables[i][p // block] * block + p % block
        for i, (n, c) in enumerate(zip(query_lens, context_lens))
        for p in range(c - n, c)
    ]
    batch = AttentionBatch(query_lens, context_lens, tables, torch.tensor(slots))
    pool = torch.randn(9, 2, block, kv_heads, dim)
    tokens = sum(query_lens)
    q = torch.randn(tokens, heads, dim)
    k, v = torch.randn(tokens, kv_heads, dim), torch.randn(tokens, kv_heads, dim)
    sinks = torch.tensor([-1.0, 0.5, 2.0, 4.0])
    seq = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
    pos = torch.cat([torch.arange(c - n, c) for n, c in zip(query_lens, context_lens)])
    padded = [t + [0] * (3 - len(t)) for t in tables]
    names = ["torch"] + (["invariant"] if fused.OPS is not None else [])
    for name in names:
        backend = create_backend(
            name,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=dim,
            block_size=block,
            sliding_window=window,
            device=torch.device("cpu"),
            dtype=torch.float32,
        )
        layer = pool.clone()
        out = backend.forward(q, k, v, layer, backend.plan(batch), sinks)
        expected = reference(
            q, layer[:, 0], layer[:, 1], padded, seq, pos, window or 0, sinks, dim**-0.5
        )
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5, msg=name)


def test_a_model_with_sinks_gets_a_backend_that_takes_them(monkeypatch):
    """Where `auto` would pick FlashInfer (CUDA with it installed), which takes no sinks, the
    torch backend instead; FlashInfer named is refused in one line."""
    import engine.attention as attention
    from engine.attention.torch_backend import TorchBackend

    picks = {"auto": "flashinfer", "flashinfer": "flashinfer"}
    monkeypatch.setattr(
        attention, "resolve_backend_name", lambda name, device: picks.get(name, name)
    )
    shape = dict(
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
        sliding_window=None,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    assert type(create_backend("auto", sinks=True, **shape)) is TorchBackend
    with pytest.raises(ValueError, match="takes no attention sinks"):
        create_backend("flashinfer", sinks=True, **shape)
