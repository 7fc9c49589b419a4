"""Sampling: seeds reproduce, the batch does not matter, and draws follow the filtered softmax."""

from __future__ import annotations

import math

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampler import SamplingBatch, filter_logits, sample
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])


def draw_many(params: SamplingParams, n: int) -> torch.Tensor:
    """n draws from LOGITS, each with its own seed, in one batched call."""
    seqs = [Sequence(f"s{i}", [0], params, seed=i) for i in range(n)]
    batch = SamplingBatch.from_sequences(seqs, LOGITS.numel(), torch.device("cpu"))
    tokens, _, _ = sample(LOGITS.expand(n, -1).contiguous(), batch)
    return tokens


def expected_probs(
    temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> torch.Tensor:
    probs = (LOGITS / temperature).softmax(-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    mass = 0.0
    for rank, i in enumerate(order.tolist()):
        if (top_k and rank >= top_k) or mass >= top_p or probs[i] < min_p * probs.max():
            continue
        keep[i] = True
        mass += probs[i].item()
    filtered = torch.where(keep, probs, 0.0)
    return filtered / filtered.sum()


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=1.0),
        dict(temperature=0.7, top_p=0.8),
        dict(temperature=1.3, top_k=3),
        dict(temperature=1.0, min_p=0.2),
    ],
)
def test_draws_follow_the_filtered_softmax(params):
    n = 40_000
    counts = torch.bincount(
        draw_many(SamplingParams(**params), n), minlength=LOGITS.numel()
    ).double()
    probs = expected_probs(**params).double()
    assert torch.all(counts[probs == 0] == 0), "a filtered-out token was drawn"
    observed, expected = counts[probs > 0], probs[probs > 0] * n
    chi2 = ((observed - expected) ** 2 / expected).sum().item()
    dof = observed.numel() - 1
    # Far above the 99.9th percentile of chi-square for these few degrees of freedom.
    assert chi2 < dof + 6 * math.sqrt(2 * dof) + 10, (chi2, observed.tolist(), expected.tolist())


def test_greedy_takes_the_argmax_and_reports_its_logprob():
    seqs = [Sequence("g", [0], SamplingParams(temperature=0, logprobs=True), seed=1)]
    batch = SamplingBatch.from_sequences(seqs, LOGITS.numel(), torch.device("cpu"))
    tokens, logprobs, _ = sample(LOGITS[None], batch)
    assert tokens.tolist() == [0]
    torch.testing.assert_close(logprobs, LOGITS.log_softmax(-1)[:1])


def test_filter_keeps_at_least_the_top_token():
    seqs = [Sequence("f", [0], SamplingParams(top_p=1e-6, top_k=1), seed=1)]
    batch = SamplingBatch.from_sequences(seqs, LOGITS.numel(), torch.device("cpu"))
    kept = torch.isfinite(filter_logits(LOGITS[None], batch))
    assert kept.tolist() == [[True] + [False] * (LOGITS.numel() - 1)]


@pytest.fixture(scope="module")
def engine(hf_checkpoint):
    return LLMEngine(
        EngineConfig(model=hf_checkpoint("qwen2")[1], dtype="float32", kv_cache_bytes=8 << 20)
    )


def test_same_seed_gives_same_tokens_whatever_the_batch(engine):
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    prompt = [4, 8, 15, 16, 23, 42]
    alone = engine.generate([prompt], params)[0].token_ids
    again = engine.generate([prompt], params)[0].token_ids
    other = SamplingParams(max_tokens=20, temperature=0.8, seed=99, ignore_eos=True)
    in_batch = engine.generate([[1, 2, 3], prompt, list(range(30))], [other, params, other])[
        1
    ].token_ids
    different_seed = engine.generate(
        [prompt], SamplingParams(max_tokens=20, seed=1235, ignore_eos=True)
    )[0].token_ids
    assert alone == again == in_batch
    assert different_seed != alone
