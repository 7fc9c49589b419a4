"""Multi-head latent attention in the paged cache (engine/models/deepseek_v3.py): one entry of
latent + rope part per token, no separate V; a prompt served from that cache, or computed in
chunks over it, gives the same tokens as computed whole."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.kv_cache import bytes_per_block
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPT = list(range(40, 97))  # 57 tokens: three full blocks and a part


def engine(folder: str, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=folder, dtype="float32", kv_cache_bytes=2 << 20, **kwargs))


def test_the_cache_keeps_one_latent_entry_per_token(hf_checkpoint):
    e = engine(hf_checkpoint("deepseek_v3")[1])
    mla = e.model_config.mla
    _, _, entries, block_size, heads, dim = e.kv_cache.pool.shape
    assert (entries, heads, dim) == (1, 1, mla.kv_lora_rank + mla.qk_rope_head_dim)  # 32 + 8
    # K and V per head
    plain = 2 * e.model_config.num_heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim)
    per_token = (
        bytes_per_block(e.model_config, block_size, e.dtype)
        / block_size
        / e.model_config.num_layers
        / 4
    )
    assert per_token == 40 and plain / per_token == 4.8


def test_cached_and_chunked_prompts_give_the_tokens_of_a_whole_one(hf_checkpoint):
    folder = hf_checkpoint("deepseek_v3")[1]
    whole = engine(folder, enable_prefix_caching=False).generate([PROMPT], GREEDY)[0].token_ids
    cached = engine(folder)
    cached.generate([PROMPT[:40]], GREEDY)
    again = cached.generate([PROMPT], GREEDY)[0]
    assert again.num_cached_tokens == 32 and again.token_ids == whole
    chunked = engine(
        folder, max_num_batched_tokens=16, wave_batched_tokens=0, enable_prefix_caching=False
    )
    assert chunked.generate([PROMPT], GREEDY)[0].token_ids == whole
