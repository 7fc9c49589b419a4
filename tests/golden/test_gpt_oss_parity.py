"""gpt-oss against transformers on a tiny random checkpoint in OpenAI's published layout
(tests/tiny_models.py "gpt_oss": MXFP4 experts that transformers dequantizes itself, sinks, a
sliding window of 8 between full layers; test_transformers_parity.py checks every row's
logits): greedy tokens and each step's logprobs are transformers', read from the prefix cache
past the window, on two tensor-parallel ranks (with whole experts each, or half of each), and
with ngram speculation; the experts stay 4-bit; transformers' own (dense) save is served too."""

from __future__ import annotations

import pytest
import torch

from engine.checkpoint import Checkpoint
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.golden.test_transformers_parity import PROMPTS, hf_greedy
from tests.tiny_models import build_hf_model

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=True)


def make_engine(folder: str, **overrides) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=folder, dtype="float32", kv_cache_bytes=8 << 20, **overrides)
    )


def hf_logprobs(model, prompt: list[int], reply: list[int]) -> list[float]:
    """Each reply token's logprob under transformers, from one pass over prompt + reply."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + reply[:-1]])).logits[0, len(prompt) - 1 :]
    return logits.log_softmax(-1).gather(1, torch.tensor(reply)[:, None])[:, 0].tolist()


def assert_transformers(model, prompts, completions) -> None:
    for prompt, completion in zip(prompts, completions):
        reply = completion.token_ids
        assert reply == hf_greedy(model, prompt, len(reply)), f"prompt of {len(prompt)} tokens"
        assert completion.logprobs == pytest.approx(hf_logprobs(model, prompt, reply), abs=1e-4)


@pytest.fixture(scope="module")
def gpt_oss(hf_checkpoint):
    return hf_checkpoint("gpt_oss")


def test_greedy_tokens_and_logprobs_equal_transformers_and_a_repeat_reads_the_cache(gpt_oss):
    model, folder = gpt_oss
    engine = make_engine(folder)
    assert_transformers(model, PROMPTS, engine.generate(PROMPTS, GREEDY))
    # 37 tokens: two blocks of 16 cached, past the sliding layers' window of 8
    again = engine.generate([PROMPTS[1]], GREEDY)
    assert again[0].num_cached_tokens == 32
    assert_transformers(model, PROMPTS[1:2], again)


@pytest.mark.parametrize("expert_parallel", [True, False], ids=["ep", "tp"])
def test_two_ranks_give_transformers_tokens(gpt_oss, expert_parallel):
    """Whole experts a rank (each adding its own biases), or half of every expert's units (gate
    and up interleaved, down's MXFP4 columns a group of 32 each; one rank adds the biases)."""
    model, folder = gpt_oss
    engine = make_engine(folder, tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
    try:
        assert_transformers(model, PROMPTS[:2], engine.generate(PROMPTS[:2], GREEDY))
    finally:
        engine.close()


def test_ngram_speculation_is_lossless(gpt_oss):
    model, folder = gpt_oss
    engine = make_engine(folder, speculative="ngram", num_speculative_tokens=4)
    # the tiny model's replies repeat themselves: drafts found and accepted (how many the
    # speculator tries adapts to the steps' timings)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=True)
    prompts = [[3] * 16, PROMPTS[1]]
    assert_transformers(model, prompts, engine.generate(prompts, params))
    assert engine.speculator.num_accepted > 0


def test_the_experts_stay_four_bit_in_memory(gpt_oss, monkeypatch):
    monkeypatch.setenv("TANDEM_KERNELS", "invariant")  # the kernel that keeps them packed
    _, folder = gpt_oss
    stored = Checkpoint(folder).weights
    engine = make_engine(folder)
    for i, layer in enumerate(engine.model.layers):
        quantized = sum(
            stored[f"model.layers.{i}.mlp.experts.{proj}_{part}"].nbytes
            for proj in ("gate_up_proj", "down_proj")
            for part in ("blocks", "scales")
        )
        stacked = layer.mlp.stacked  # every expert's packed blocks and scales, one tensor each
        held = [stacked.gate_up, stacked.gate_up_scales, stacked.down, stacked.down_scales]
        assert all(t.dtype == torch.uint8 for t in held)
        assert sum(t.nbytes for t in held) <= 1.15 * quantized


def test_transformers_own_dense_save_is_served_too(tmp_path):
    model = build_hf_model("gpt_oss")
    model.save_pretrained(tmp_path)  # experts [experts, in, out], unquantized
    engine = make_engine(str(tmp_path))
    assert_transformers(model, PROMPTS[:2], engine.generate(PROMPTS[:2], GREEDY))
