"""A worker's load gauges, which its role's autoscaler reads (deploy/k8s): prompt tokens not
yet computed (prefill), and the context of the requests decoding (decode)."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from services.worker import metrics
from services.worker.engine_loop import EngineLoop


def test_pending_prompt_tokens_turn_into_decode_tokens(hf_checkpoint):
    engine = LLMEngine(
        EngineConfig(
            model=hf_checkpoint("llama")[1],
            dtype="float32",
            kv_cache_bytes=4 << 20,
            max_num_batched_tokens=64,
            wave_batched_tokens=0,  # chunks of 64 also while more prompt tokens wait
        )
    )
    loop = EngineLoop(engine)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine.add_request("a", list(range(3, 103)), params)  # 100 prompt tokens: two chunks of 64
    engine.add_request("b", list(range(3, 23)), params)
    loop._publish_stats()
    assert (loop.stats.num_prompt_tokens_pending, loop.stats.num_decode_tokens_running) == (120, 0)
    engine.step()  # 64 of a's prompt
    loop._publish_stats()
    assert loop.stats.num_prompt_tokens_pending == 56
    while loop.stats.num_prompt_tokens_pending:
        engine.step()
        loop._publish_stats()
    assert (
        loop.stats.num_decode_tokens_running
        == sum(s.num_tokens for s in engine.scheduler.running)
        >= 122
    )
    sample = metrics.REGISTRY.get_sample_value
    assert sample("tandem:num_decode_tokens_running") == loop.stats.num_decode_tokens_running
    assert sample("tandem:num_prompt_tokens_pending") == 0
