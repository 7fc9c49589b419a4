"""Golden tests: the engine against Hugging Face transformers on the same tiny random weights."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.tiny_models import ARCHITECTURES, build_hf_model

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
PROMPTS = [
    [5, 17, 101, 33, 250, 7, 81],
    list(range(40, 77)),  # crosses two block boundaries
    [3] * 16,  # exactly one full block
    [200, 201, 11],
]


def make_engine(folder: str, **overrides) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=folder, dtype="float32", kv_cache_bytes=8 << 20, **overrides)
    )


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_prefill_and_decode_logits_match_transformers(arch, hf_checkpoint):
    model, folder = hf_checkpoint(arch)
    engine = make_engine(folder)
    recorded = []
    execute = engine.runner.execute

    def record_every_row(inputs, all_logits=False, **kwargs):
        logits = execute(inputs, all_logits=True, **kwargs)
        recorded.append(logits.cpu())  # the reference runs on CPU
        return logits[inputs.sample_rows]

    engine.runner.execute = record_every_row
    prompt = PROMPTS[1]
    [completion] = engine.generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    )

    full = prompt + completion.token_ids
    with torch.no_grad():
        reference = model(torch.tensor([full[:-1]])).logits[0]
    # Step 0 is the prefill (every prompt position); then one decode step per token.
    torch.testing.assert_close(recorded[0], reference[: len(prompt)], rtol=1e-4, atol=1e-4)
    decode_logits = torch.cat(recorded[1:])
    torch.testing.assert_close(decode_logits, reference[len(prompt) :], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_batched_greedy_generation_equals_transformers(arch, hf_checkpoint):
    model, folder = hf_checkpoint(arch)
    engine = make_engine(folder)
    completions = engine.generate(PROMPTS, GREEDY)
    for prompt, completion in zip(PROMPTS, completions):
        assert completion.token_ids == hf_greedy(model, prompt, 32), (
            f"prompt of {len(prompt)} tokens"
        )
        assert completion.finish_reason == "length"


def test_bf16_checkpoint_runs_close_to_fp32(tmp_path):
    model = build_hf_model("qwen3")
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    model.float()  # the reference: the same bf16-rounded weights, computed in fp32
    engine = LLMEngine(EngineConfig(model=str(tmp_path), kv_cache_bytes=8 << 20))
    assert engine.dtype == torch.bfloat16  # auto: the checkpoint's dtype
    recorded = []
    execute = engine.runner.execute
    engine.runner.execute = lambda inputs, all_logits=False, **kw: (
        recorded.append(execute(inputs, **kw)) or recorded[-1]
    )
    engine.generate([PROMPTS[0], PROMPTS[1]], SamplingParams(max_tokens=1, temperature=0))
    with torch.no_grad():
        reference = torch.stack([model(torch.tensor([p])).logits[0, -1] for p in PROMPTS[:2]])
    torch.testing.assert_close(recorded[0].cpu(), reference, rtol=0.05, atol=0.05)
