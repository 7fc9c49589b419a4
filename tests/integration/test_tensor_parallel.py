"""Tensor, expert and pipeline parallelism with real rank processes over gloo: TP=2, TP=2 with
the experts placed whole across the ranks (EP), and PP=2 give the greedy tokens of one
process, with logits within fp32 tolerance, for a dense model, each mixture of experts and
the quantized checkpoints as published; a model that does not divide is refused clearly."""

from __future__ import annotations

import pytest
import torch

from engine import model_runner
from engine.config import EngineConfig
from engine.errors import CheckpointError
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

PROMPTS = [list(range(40, 77)), [5, 17, 101, 33, 250, 7, 81], [3] * 16]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def run(
    folder: str, tp: int = 1, ep: bool = False, pp: int = 1, prompts: list[list[int]] = PROMPTS
) -> tuple[list[list[int]], list[torch.Tensor]]:
    engine = LLMEngine(
        EngineConfig(
            model=folder,
            dtype="float32",
            kv_cache_bytes=4 << 20,
            tensor_parallel_size=tp,
            enable_expert_parallel=ep,
            pipeline_parallel_size=pp,
        )
    )
    logits = []
    execute = engine.runner.execute
    engine.runner.execute = lambda inputs, **kw: logits.append(execute(inputs, **kw)) or logits[-1]
    try:
        return [r.token_ids for r in engine.generate(prompts, GREEDY)], logits
    finally:
        engine.close()


@pytest.mark.parametrize(
    "arch, layout",
    [
        ("llama", "tp"),
        ("qwen3_moe", "tp"),
        ("mixtral", "tp"),
        ("qwen3_moe", "ep"),
        ("mixtral", "ep"),
        ("deepseek_v3", "tp"),
        ("deepseek_v3", "ep"),
        # as published: FP8 blocks, INT4 routed experts (nested K2.5)
        ("deepseek_v3_fp8", "tp"),
        ("kimi_k2_fp8", "ep"),
        ("kimi_k25", "tp"),
        ("kimi_k25", "ep"),
        ("llama", "pp"),
        ("qwen3_moe", "pp"),
        ("mixtral", "pp"),
        ("deepseek_v3", "pp"),
        ("llama", "tp2pp2"),
        ("qwen3_moe", "tp2pp2"),
    ],
)
def test_two_ranks_give_one_rank_s_tokens_and_logits(hf_checkpoint, arch, layout):
    folder = hf_checkpoint(arch)[1]
    one_tokens, one_logits = run(folder)
    two_tokens, two_logits = run(
        folder,
        **{
            "tp": dict(tp=2),
            "ep": dict(tp=2, ep=True),
            "pp": dict(pp=2),
            "tp2pp2": dict(tp=2, pp=2),
        }[layout],
    )
    assert two_tokens == one_tokens
    assert len(two_logits) == len(one_logits)
    if (
        layout == "tp"
    ):  # the vocabulary splits across the two ranks: rank 0 holds half of each table
        engine = LLMEngine(
            EngineConfig(
                model=folder, dtype="float32", kv_cache_bytes=4 << 20, tensor_parallel_size=2
            )
        )
        vocab = engine.model_config.vocab_size
        assert engine.model.vocab_split and engine.model.embedding.table.shape[0] == vocab // 2
        assert engine.model.embedding_table().shape[0] == vocab
        engine.close()
    for a, b in zip(two_logits, one_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch, layout", [("llama", dict(pp=2)), ("qwen3_moe", dict(tp=2, pp=2))])
def test_pipeline_micro_batches_give_one_rank_s_tokens_and_logits(
    hf_checkpoint, monkeypatch, arch, layout
):
    """Prompt steps of 256 tokens and more go through the stages as two micro-batches (one
    prompt cut in two among them); the tokens and logits are one process's."""
    folder = hf_checkpoint(arch)[1]
    prompts = [
        [(i * 7) % 370 + 3 for i in range(300)],
        list(range(40, 77)),
        [5, 17, 101, 33, 250, 7, 81],
    ]
    parts = []
    cut = model_runner.micro_batches
    monkeypatch.setattr(
        model_runner, "micro_batches", lambda plan: parts.append(plan.parts) or cut(plan)
    )
    one_tokens, one_logits = run(folder, prompts=prompts)
    two_tokens, two_logits = run(folder, prompts=prompts, **layout)
    assert 2 in parts and 1 in parts  # the prompt step in two parts, the decode steps whole
    assert two_tokens == one_tokens
    for a, b in zip(two_logits, one_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_a_model_that_does_not_divide_is_refused(hf_checkpoint):
    with pytest.raises(CheckpointError, match="tensor_parallel_size 3 does not divide"):
        LLMEngine(
            EngineConfig(
                model=hf_checkpoint("llama")[1],
                dtype="float32",
                kv_cache_bytes=4 << 20,
                tensor_parallel_size=3,
            )
        )
    with pytest.raises(
        CheckpointError, match="pipeline_parallel_size 3 exceeds the model's 2 layers"
    ):
        LLMEngine(
            EngineConfig(
                model=hf_checkpoint("llama")[1],
                dtype="float32",
                kv_cache_bytes=4 << 20,
                pipeline_parallel_size=3,
            )
        )
