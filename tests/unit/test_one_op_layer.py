"""engine/models/one_op_layer.py: a GGUF llama layer as one op computes the very bits of the
Python layer, for prompts in one batch and alone, at prefill and at decode."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.layers import fused
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.gguf_files import T, write_tiny_gguf

pytestmark = pytest.mark.skipif(
    not hasattr(fused.OPS, "gguf_decoder_layer"), reason="the CPU ops are not built"
)
PROMPTS = [[5, 17, 101, 33, 250, 7, 81], list(range(300, 337)), [200, 201, 11]]


def run(path: str, batched: bool) -> tuple[LLMEngine, list]:
    engine = LLMEngine(EngineConfig(model=path, kv_cache_bytes=8 << 20))
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=True)
    if batched:
        return engine, engine.generate(PROMPTS, params)
    return engine, [engine.generate([p], params)[0] for p in PROMPTS]


@pytest.mark.parametrize("batched", [True, False], ids=["batch", "alone"])
def test_the_one_op_layer_computes_the_python_layers_bits(batched, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    kinds = dict(token_embd=T.Q8_0, output=T.Q6_K, attn=T.Q4_1, ffn=T.Q4_K)
    path = write_tiny_gguf(str(tmp_path / "tiny.gguf"), "llama", kinds)
    engine, one_op = run(path, batched)
    assert all(layer.one_op is not None for layer in engine.runner.model.layers)
    monkeypatch.setattr("engine.models.llama.one_op", lambda layer, ranks: None)
    engine, python = run(path, batched)
    assert all(layer.one_op is None for layer in engine.runner.model.layers)
    for a, b in zip(one_op, python):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs  # the same bits
