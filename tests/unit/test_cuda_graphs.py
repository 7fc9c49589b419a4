"""Decode steps through the CUDA graphs' padded, staged path give the eager engine's tokens.

On CPU the graphs' path runs eagerly (no capture), so padding, the scratch block, the staging
buffer and the in-graph attention plan are checked here; on CUDA the last test captures too.
"""

from __future__ import annotations

import pytest
import torch

from engine import llm_engine
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.unit.test_batching import run_staggered

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=True)
# Batches from 1 to 5 sequences (padded to 1, 2, 4 and 8), spanning 1 to 12 pages (buckets 8 and 16).
PROMPTS = [list(range(10, 47)), [7, 8, 9], list(range(100, 270)), [42] * 20, list(range(300, 317))]


def make_engine(folder: str, device: str = "cpu", **overrides) -> LLMEngine:
    # The graphs run torch's attention (the CPU default, the invariant backend, has no graph path).
    return LLMEngine(
        EngineConfig(
            model=folder,
            dtype="float32",
            device=device,
            kv_cache_bytes=8 << 20,
            attention_backend="torch",
            **overrides,
        )
    )


def graphed_engine(
    folder: str, monkeypatch, device: str = "cpu"
) -> tuple[LLMEngine, list[tuple[int, int]]]:
    """An engine with decode graphs (on CPU: the graphs' path, eagerly), and the list of
    (batch, pages) buckets its replays used."""
    monkeypatch.setattr(llm_engine, "decode_graphs_wanted", lambda *args: True)
    engine = make_engine(folder, device)
    buckets: list[tuple[int, int]] = []
    replay = engine.runner.graphs.replay

    def counted(step):
        buckets.append(step[1:])
        return replay(step)

    monkeypatch.setattr(engine.runner.graphs, "replay", counted)
    return engine, buckets


def eager_and_graphed(folder: str, monkeypatch, device: str = "cpu"):
    eager = run_staggered(
        make_engine(folder, device, enforce_eager=True), PROMPTS, GREEDY, steps_between=3
    )
    engine, buckets = graphed_engine(folder, monkeypatch, device)
    return eager, run_staggered(engine, PROMPTS, GREEDY, steps_between=3), engine, buckets


@pytest.mark.parametrize("arch", ["llama", "mistral_window", "qwen3", "gemma3"])
def test_graph_path_equals_eager(hf_checkpoint, monkeypatch, arch):
    eager, graphed, engine, buckets = eager_and_graphed(hf_checkpoint(arch)[1], monkeypatch)
    assert graphed == eager
    assert {batch for batch, _ in buckets} >= {1, 2, 4, 8} and {pages for _, pages in buckets} == {
        8,
        16,
    }
    # the scratch block is the graphs' alone
    assert engine.num_blocks == engine.kv_cache.num_blocks - 1


def test_logprobs_match_eager(hf_checkpoint, monkeypatch):
    folder = hf_checkpoint("llama")[1]
    prompts = PROMPTS[:3]
    eager = make_engine(folder, enforce_eager=True).generate(prompts, GREEDY)
    engine, buckets = graphed_engine(folder, monkeypatch)
    graphed = engine.generate(prompts, GREEDY)
    assert buckets
    for a, b in zip(eager, graphed):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(
            torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=1e-4, atol=1e-4
        )


def test_steps_that_do_not_fit_run_eagerly(hf_checkpoint, monkeypatch):
    """A prompt step, and a decode longer than the graphs' pages, take the eager path."""
    engine, buckets = graphed_engine(hf_checkpoint("llama")[1], monkeypatch)
    graphs: DecodeGraphs = engine.runner.graphs
    assert not graphs.fits([5], [[0]]) and not graphs.fits([1], [[0] * (graphs.max_pages + 1)])
    assert graphs.fits([1, 1], [[0], [1, 2]])
    engine.generate([list(range(10, 40))], SamplingParams(max_tokens=1, temperature=0))
    assert buckets == []  # the prompt step alone


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_graphs_equal_eager_on_cuda(hf_checkpoint, monkeypatch):
    eager, graphed, engine, buckets = eager_and_graphed(
        hf_checkpoint("llama")[1], monkeypatch, "cuda"
    )
    assert graphed == eager
    assert engine.runner.graphs.capture and set(engine.runner.graphs.graphs) == set(buckets)
