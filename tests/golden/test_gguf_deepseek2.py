"""deepseek2 GGUF files (DeepSeek-V3 / Kimi K2 as llama.cpp writes them) against transformers'
DeepseekV3ForCausalLM holding the file's own weights: transformers cannot read deepseek2 files,
so the test writes the file from a tiny model and gives the model back the dequantized values
(tests/gguf_deepseek2.py). Served from the file alone (config.json from its metadata, kv_b_proj
from attn_k_b / attn_v_b or attn_kv_b), greedy tokens must be equal and each step's logprob
within the golden tolerance."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.errors import CheckpointError
from engine.gguf.folder import model_folder
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.gguf_deepseek2 import FORMS, tiny_deepseek_v3, write_deepseek2_gguf
from tests.gguf_files import T, model_greedy

KINDS = dict(token_embd=T.Q8_0, output=T.Q8_0, attn=T.Q8_0, ffn=T.Q4_1, experts=T.Q4_0)
PROMPTS = [[5, 17, 101, 33, 250, 7, 81], list(range(300, 337)), [200, 201, 11]]
STEPS = 12


def transformers_greedy(model, prompt: list[int]) -> tuple[list[int], list[float]]:
    return model_greedy(model, prompt, STEPS)


@pytest.mark.parametrize("form", FORMS)
def test_deepseek2_greedy_tokens_and_logprobs_equal_transformers(form, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    model = tiny_deepseek_v3(form)
    path = write_deepseek2_gguf(model, str(tmp_path / f"tiny-deepseek2-{form}.gguf"), KINDS, form)
    engine = LLMEngine(EngineConfig(model=path, kv_cache_bytes=8 << 20))
    params = SamplingParams(max_tokens=STEPS, temperature=0, ignore_eos=True, logprobs=True)
    completions = engine.generate(PROMPTS, params)  # in one batch
    for prompt, completion in zip(PROMPTS, completions):
        tokens, logprobs = transformers_greedy(model, prompt)
        assert completion.token_ids == tokens, f"prompt of {len(prompt)} tokens"
        torch.testing.assert_close(
            torch.tensor(completion.logprobs), torch.tensor(logprobs), rtol=1e-4, atol=1e-4
        )


def test_softmax_gated_deepseek2_is_refused_in_one_line(tmp_path, monkeypatch):
    """DeepSeek-V2's files (softmax gating, or none stated) name what is not served."""
    import gguf

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(
        gguf.GGUFWriter,
        "add_expert_gating_func",
        lambda self, _: self.add_uint32(f"{self.arch}.expert_gating_func", 1),
    )
    path = write_deepseek2_gguf(tiny_deepseek_v3("split"), str(tmp_path / "v2.gguf"), KINDS)
    with pytest.raises(CheckpointError, match=r"v2\.gguf: deepseek2 with softmax expert gating"):
        model_folder(path)
