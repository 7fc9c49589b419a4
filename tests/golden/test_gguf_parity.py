"""GGUF files against transformers' GGUF loader on the same file: tiny random models of each
architecture served from GGUF, every kept quantized type among their tensors, llama's Q and K
rows permuted as llama.cpp's converter writes them. Greedy tokens must be equal, and each
step's logprob within the golden tolerance."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.gguf_files import T, model_greedy, write_tiny_gguf

CASES = {
    "llama": ("llama", dict(token_embd=T.Q8_0, output=T.Q6_K, attn=T.Q4_0, ffn=T.Q4_1), False),
    "qwen2_tied": ("qwen2", dict(token_embd=T.Q8_0, attn=T.Q5_1, ffn=T.Q5_K), True),
    "qwen3": ("qwen3", dict(token_embd=T.F16, output=T.Q5_0, attn=T.Q4_K, ffn=T.Q6_K), False),
    "qwen3moe": (
        "qwen3moe",
        dict(token_embd=T.Q4_0, output=T.Q8_0, attn=T.Q5_0, experts=T.Q4_K),
        False,
    ),
    # six layers (the sixth global, a window of 16 on the others), tied embeddings
    "gemma3": ("gemma3", dict(token_embd=T.Q8_0, attn=T.Q4_K, ffn=T.Q5_0), True),
}
PROMPTS = [[5, 17, 101, 33, 250, 7, 81], list(range(300, 337)), [200, 201, 11]]
STEPS = 12


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    made = {}

    def make(case: str) -> str:
        if case not in made:
            arch, kinds, tied = CASES[case]
            folder = tmp_path_factory.mktemp(case)
            made[case] = write_tiny_gguf(str(folder / f"tiny-{case}.gguf"), arch, kinds, tied=tied)
        return made[case]

    return make


def transformers_greedy(path: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    import os

    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return model_greedy(model, prompt, STEPS)


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_greedy_tokens_and_logprobs_equal_transformers(case, gguf_file, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    path = gguf_file(case)
    engine = LLMEngine(EngineConfig(model=path, kv_cache_bytes=8 << 20))
    params = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True, logprobs=True)
    completions = engine.generate(PROMPTS, params)  # in one batch
    for prompt, completion in zip(PROMPTS, completions):
        tokens, logprobs = transformers_greedy(path, prompt)
        assert completion.token_ids == tokens, f"prompt of {len(prompt)} tokens"
        torch.testing.assert_close(
            torch.tensor(completion.logprobs), torch.tensor(logprobs), rtol=1e-4, atol=1e-4
        )


@pytest.mark.parametrize("case", ["llama", "gemma3"])
def test_gguf_in_bf16_follows_transformers_in_bf16(case, gguf_file, tmp_path, monkeypatch):
    """`--dtype bfloat16`: the dequantized weights rounded to bf16, bf16 activations, bf16
    products summed in fp32 (engine/csrc/gguf_linear.cpp). Against transformers in bf16 on the
    same file dequantized to bf16, teacher-forced on tandem's greedy tokens (a near tie may go
    either way in bf16): each of them is within the tolerance of the reference's best token, and
    its logprob the reference's. The tolerance is bf16's: logits near 10 are 1/16 apart, and
    transformers' own bf16 is up to 0.21 from its fp32 on these models (tandem's: 0.11 from it)."""
    import os

    from transformers import AutoModelForCausalLM, GgufConfig

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    path = gguf_file(case)
    engine = LLMEngine(EngineConfig(model=path, dtype="bfloat16", kv_cache_bytes=8 << 20))
    assert engine.dtype == torch.bfloat16
    params = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True, logprobs=True)
    completions = engine.generate(PROMPTS, params)
    folder, name = os.path.split(path)
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        gguf_file=name,
        dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True),
    ).eval()
    for prompt, completion in zip(PROMPTS, completions):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion.token_ids])).logits[0]
        reference = torch.log_softmax(logits[len(prompt) - 1 : -1].float(), -1)
        chosen = reference[torch.arange(STEPS), torch.tensor(completion.token_ids)]
        assert (reference.max(-1).values - chosen).max() < 0.15, f"prompt of {len(prompt)} tokens"
        torch.testing.assert_close(torch.tensor(completion.logprobs), chosen, rtol=0, atol=0.15)
