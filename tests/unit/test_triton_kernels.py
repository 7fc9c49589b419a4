"""The Triton kernels made for CUDA (engine/triton), run here in Triton's interpreter: paged
decode attention equals the torch backend's SDPA, alone and inside an engine's decode steps
(the CUDA graphs' path included)."""

from __future__ import annotations

import pytest
import torch

from engine import llm_engine
from engine.attention.base import AttentionBatch
from engine.attention.torch_backend import TorchBackend
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

pytest.importorskip("triton")
from engine.triton.paged_decode import paged_decode_attention  # noqa: E402

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,latent,window,block_size,dtype",
    [
        (4, 2, 64, None, None, 16, torch.float32),  # grouped-query
        (6, 6, 32, None, None, 8, torch.float32),  # a tile spans pages smaller than itself
        (4, 1, 40, None, 7, 16, torch.float32),  # a sliding window; a head_dim padded to 64
        (40, 1, 96, 64, None, 16, torch.float32),  # MLA's latent; heads split over programs
        (4, 2, 64, None, None, 16, torch.bfloat16),
    ],
)
def test_paged_decode_equals_sdpa(heads, kv_heads, head_dim, latent, window, block_size, dtype):
    torch.manual_seed(1)
    backend = TorchBackend(
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        sliding_window=window,
        device=CPU,
        dtype=dtype,
        latent_v_dim=latent,
    )
    pool = torch.randn(24, 1 if latent else 2, block_size, kv_heads, head_dim, dtype=dtype)
    # Contexts of one token, within one page, across pages (tables out of order), past a tile.
    contexts = [1, block_size - 3, 2 * block_size + 5, 70]
    pages = torch.randperm(23)  # block 23 stays unused
    tables, at = [], 0
    for n in contexts:
        count = -(-n // block_size)
        tables.append(pages[at : at + count].tolist())
        at += count
    slots = torch.tensor(
        [
            t[(n - 1) // block_size] * block_size + (n - 1) % block_size
            for t, n in zip(tables, contexts)
        ]
    )
    batch = AttentionBatch([1] * len(contexts), contexts, tables, slots)
    q = torch.randn(len(contexts), heads, head_dim, dtype=dtype)
    k = torch.randn(len(contexts), kv_heads, head_dim, dtype=dtype)
    v = None if latent else torch.randn(len(contexts), kv_heads, head_dim, dtype=dtype)
    expected = backend.forward(q, k, v, pool, backend.plan(batch))  # writes the new K/V too
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [23] * (width - len(t)) for t in tables])
    got = paged_decode_attention(
        q, pool, padded, torch.tensor(contexts), backend.scale, window, latent
    )
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, expected, **tolerance)


GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=True)
PROMPTS = [list(range(10, 47)), [7, 8, 9], [42] * 20]


def _engine(folder: str, backend: str) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=folder,
            dtype="float32",
            device="cpu",
            kv_cache_bytes=8 << 20,
            attention_backend=backend,
            max_model_len=256,
        )
    )


@pytest.mark.parametrize("arch", ["llama", "mistral_window", "deepseek_v3"])
def test_engine_decodes_through_the_kernel_as_through_sdpa(hf_checkpoint, monkeypatch, arch):
    """The whole engine with the Triton backend, its decode steps on the CUDA graphs' path (run
    eagerly on CPU): the torch backend's tokens, and logprobs within rounding."""
    folder = hf_checkpoint(arch)[1]
    expected = _engine(folder, "torch").generate(PROMPTS, GREEDY)
    monkeypatch.setattr(llm_engine, "decode_graphs_wanted", lambda *args: True)
    engine = _engine(folder, "triton")
    graphs = engine.runner.graphs
    replays = []
    replay = graphs.replay
    monkeypatch.setattr(graphs, "replay", lambda step: replays.append(step) or replay(step))
    got = engine.generate(PROMPTS, GREEDY)
    assert replays  # decode steps took the graphs' path
    for a, b in zip(expected, got):
        assert b.token_ids == a.token_ids
        torch.testing.assert_close(
            torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=1e-4, atol=1e-4
        )
