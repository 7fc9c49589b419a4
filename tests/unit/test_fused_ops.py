"""The fused CPU ops (engine/csrc/fused_ops.cpp) compute what the eager layers compute, and an
engine gives the same greedy tokens with them and without them, in fp32 and bf16."""

from __future__ import annotations

import os

import pytest
import torch

from engine.config import EngineConfig
from engine.layers import fused, norm, rotary
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.golden.test_transformers_parity import PROMPTS

pytestmark = pytest.mark.skipif(os.environ.get("TANDEM_FUSED") == "0", reason="TANDEM_FUSED=0")
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def eager(monkeypatch):
    """Runs the block with the eager torch code."""

    def run(fn, *args):
        with monkeypatch.context() as m:
            m.setattr(fused, "OPS", None)
            return fn(*args)

    return run


def test_the_ops_are_built_by_make_install():
    assert fused.OPS is not None, f"{fused.library_path()} is missing: `make install` builds it"


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    # fp32: summation order differs (a few ulps); bf16: one bf16 rounding step at most.
    tol = 1e-5 if got.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_norms_match_eager(eager, dtype, rows):
    x, r = torch.randn(rows, 96).to(dtype), torch.randn(rows, 96).to(dtype)
    w = (torch.rand(96) + 0.5).to(dtype)
    assert_same(norm.rms_norm(x, w, 1e-6), eager(norm.rms_norm, x, w, 1e-6))
    strided = torch.randn(rows, 200).to(dtype)[:, 8:104]  # rows of a wider tensor
    assert_same(norm.rms_norm(strided, w, 1e-5), eager(norm.rms_norm, strided, w, 1e-5))
    (s, h), (es, eh) = norm.add_rms_norm(x, r, w, 1e-6), eager(norm.add_rms_norm, x, r, w, 1e-6)
    assert torch.equal(s, es)
    assert_same(h, eh)
    # x is not changed in place
    assert torch.equal(x, x.clone()) and not s.data_ptr() == x.data_ptr()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_eager(eager, dtype):
    qkv = torch.randn(5, 12, 32).to(dtype)
    qk = qkv[:, :10]  # q and k heads of a fused q/k/v output: strided rows
    emb = rotary.RotaryEmbedding(32, 64, 10000.0, rotary.RopeScaling(), dtype, torch.device("cpu"))
    cos_sin = emb.lookup(torch.tensor([0, 3, 9, 17, 63]))
    assert_same(rotary.apply_rotary(qk, cos_sin), eager(rotary.apply_rotary, qk, cos_sin))


@pytest.mark.parametrize("dtype", DTYPES)
def test_interleaved_rotary_on_strided_heads_is_gathering_the_halves_first(eager, dtype):
    """DeepSeek's rope part of each head, read in place from the q projection's output."""
    q = torch.randn(5, 4, 24 + 16).to(dtype)
    q_pe = q[..., 24:]  # [T, heads, 16]: rows and heads strided
    emb = rotary.RotaryEmbedding(16, 64, 10000.0, rotary.RopeScaling(), dtype, torch.device("cpu"))
    cos_sin = emb.lookup(torch.tensor([0, 3, 9, 17, 63]))
    halves = torch.cat([q_pe[..., 0::2], q_pe[..., 1::2]], dim=-1).contiguous()
    want = rotary.apply_rotary(halves, cos_sin)
    assert torch.equal(rotary.apply_rotary(q_pe, cos_sin, interleaved=True), want)
    assert torch.equal(
        eager(rotary.apply_rotary, q_pe, cos_sin, True), eager(rotary.apply_rotary, halves, cos_sin)
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_tokens_are_the_same_with_and_without_fused_ops(
    monkeypatch, hf_checkpoint, arch, dtype
):
    _, folder = hf_checkpoint(arch)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    # Only the fused layer ops change: matmuls and attention run torch's in both.
    monkeypatch.setenv("TANDEM_KERNELS", "plain")

    def generate() -> list[list[int]]:
        engine = LLMEngine(
            EngineConfig(
                model=folder, dtype=dtype, kv_cache_bytes=8 << 20, attention_backend="torch"
            )
        )
        return [c.token_ids for c in engine.generate(PROMPTS, params)]

    fused_tokens = generate()
    monkeypatch.setattr(fused, "OPS", None)
    assert fused_tokens == generate()


def test_stale_names_sources_edited_since_the_build(tmp_path, monkeypatch):
    """Benchmarks refuse to start tandem when engine/csrc has no built library (a worker would
    run torch's kernels instead); off (TANDEM_FUSED=0) or built, nothing is stale."""
    library = tmp_path / "tandem_ops-native-0123456789abcdef.so"
    monkeypatch.setattr(fused, "library_path", lambda march: str(library))
    assert "make install" in fused.stale()
    library.write_bytes(b"")
    assert fused.stale() is None
    library.unlink()
    monkeypatch.setenv("TANDEM_FUSED", "0")
    assert fused.stale() is None
