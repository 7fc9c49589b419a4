"""Golden: Llama 4 against transformers on tiny random checkpoints in Meta's layouts
(tests/llama4_models.py): Scout-like (nested beside vision weights, 16 experts, NoPE every fourth
layer, chunks of 12 tokens) and Maverick-like (dense layers between MoE ones, FBGEMM FP8, chunks
of 20). Prompts cross chunk boundaries. The engine gives transformers' greedy tokens and
per-step logprobs; so does a repeat read from the prefix cache past a chunk boundary, the
prompt chunked, and ngram speculation; TP=2 with the experts placed whole (EP) gives one
process's tokens and logits; the FP8 weights stay FP8 in memory."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.layers.quantized.fp8_channel import Fp8ChannelWeight
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.llama4_models import maverick, scout

PROMPTS = [
    list(range(40, 77)),  # 37 tokens: past the chunks' boundaries (12, 24, 36; 20)
    [5, 17, 101, 33, 250, 7, 81],
    [3] * 16,
]
NEW_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """checkpoint(name) -> (transformers' reference, the folder)."""
    made = {}

    def make(name: str):
        if name not in made:
            folder = str(tmp_path_factory.mktemp(name))
            made[name] = ({"scout": scout, "maverick": maverick}[name](folder), folder)
        return made[name]

    return make


@pytest.fixture(scope="module")
def reference(checkpoint):
    """reference(name) -> each prompt's (greedy tokens, their logprobs), transformers'."""
    found = {}

    def of(name: str):
        if name not in found:
            model = checkpoint(name)[0]
            found[name] = []
            for prompt in PROMPTS:
                with torch.no_grad():
                    out = model.generate(
                        torch.tensor([prompt]),
                        max_new_tokens=NEW_TOKENS,
                        min_new_tokens=NEW_TOKENS,
                        do_sample=False,
                        eos_token_id=None,
                        pad_token_id=0,
                    )[0].tolist()
                    logits = model(torch.tensor([out[:-1]])).logits[0, len(prompt) - 1 :]
                tokens = out[len(prompt) :]
                logprobs = logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])
                found[name].append((tokens, logprobs[:, 0].tolist()))
        return found[name]

    return of


def engine_for(folder: str, **overrides) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=folder, dtype="float32", kv_cache_bytes=8 << 20, **overrides)
    )


def assert_matches(completions, expected) -> None:
    for completion, (tokens, logprobs) in zip(completions, expected):
        assert completion.token_ids == tokens
        torch.testing.assert_close(completion.logprobs, logprobs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["scout", "maverick"])
def test_greedy_tokens_and_logprobs_equal_transformers(name, checkpoint, reference):
    engine = engine_for(checkpoint(name)[1])
    assert_matches(engine.generate(PROMPTS, GREEDY), reference(name))


@pytest.mark.parametrize("name", ["scout", "maverick"])
def test_cached_chunked_and_speculated_equal_transformers(name, checkpoint, reference):
    """A repeat reads its first two blocks (32 tokens) from the prefix cache, past chunk
    boundaries and into a chunk it ends in; a prompt computed 16 tokens a step; ngram
    speculation verifying drafts across boundaries: transformers' tokens each time."""
    folder, expected = checkpoint(name)[1], reference(name)[:1]
    warm = engine_for(folder, speculative="ngram", num_speculative_tokens=4)
    assert_matches(warm.generate(PROMPTS[:1], GREEDY), expected)
    [again] = warm.generate(PROMPTS[:1], GREEDY)
    assert again.num_cached_tokens == 32
    assert_matches([again], expected)
    chunked = engine_for(folder, max_num_batched_tokens=16, wave_batched_tokens=0)
    assert_matches(chunked.generate(PROMPTS[:1], GREEDY), expected)


def test_fp8_weights_stay_fp8(checkpoint):
    """Every FP8 Linear's memory within 1.15x of its stored bytes and scales."""
    engine = engine_for(checkpoint("maverick")[1])
    linears = []
    for layer in engine.model.layers:
        mlp = layer.mlp
        parts = [layer.qkv_proj, layer.o_proj]
        for expert in [mlp, getattr(mlp, "shared", None), *(getattr(mlp, "experts", None) or [])]:
            if expert is not None and hasattr(expert, "gate_up_proj"):
                parts += [expert.gate_up_proj, expert.down_proj]
        linears += [lin for lin in parts if lin.rowwise is not None]
    # two layers each: attention (qkv, o), dense MLPs, shared experts, 8 experts
    assert len(linears) == 2 * 2 + 2 * 2 + 2 * 2 + 2 * 8 * 2
    held = sum(
        lin.packed.nbytes + lin.quantized["scales"].nbytes + lin.rowwise.weight_scale.nbytes
        for lin in linears
    )
    stored = sum(
        Fp8ChannelWeight(
            torch.empty(lin.out_features, lin.in_features, dtype=torch.float8_e4m3fn),
            lin.rowwise.weight_scale,
            torch.float32,
        ).nbytes
        for lin in linears
    )
    assert all(lin.weight is None for lin in linears) and held <= 1.15 * stored


@pytest.mark.parametrize("name", ["scout", "maverick"])
def test_two_ranks_with_experts_placed_whole_give_one_rank_s(name, checkpoint):
    folder = checkpoint(name)[1]
    results = []
    for parallel in ({}, dict(tensor_parallel_size=2, enable_expert_parallel=True)):
        engine = engine_for(folder, **parallel)
        logits = []
        execute = engine.runner.execute
        engine.runner.execute = lambda inputs, **kw: (
            logits.append(execute(inputs, **kw)) or logits[-1]
        )
        try:
            results.append(([c.token_ids for c in engine.generate(PROMPTS, GREEDY)], logits))
        finally:
            engine.close()
    (one_tokens, one_logits), (two_tokens, two_logits) = results
    assert two_tokens == one_tokens and len(two_logits) == len(one_logits)
    for a, b in zip(two_logits, one_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["scout", "maverick"])
def test_one_request_gives_the_same_bits_in_every_case(name, checkpoint):
    """The invariance contract (tests/unit/test_invariance.py) holds through the chunked layers,
    the experts scaling their inputs and the FP8 activations: cold, cached, chunked, beside 7
    others, on one thread or two, speculation on and off, the same bits."""
    from engine.config import ModelConfig
    from tests.unit.test_invariance import assert_all_equal, variants

    folder = checkpoint(name)[1]
    assert_all_equal(variants(folder, "float32", ModelConfig.from_folder(folder).vocab_size))
