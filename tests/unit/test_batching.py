"""Continuous batching, chunked prefill, prefix caching and preemption change no result."""

from __future__ import annotations

import pytest
import torch

from engine.block_hash import hash_blocks
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.requests import AddRequest, FromPrefill
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = [
    list(range(10, 47)),
    [7, 8, 9],
    list(range(100, 170)),
    [42] * 20,
    list(range(300, 317)),
]


def make_engine(folder: str, **overrides) -> LLMEngine:
    overrides.setdefault("kv_cache_bytes", 8 << 20)
    return LLMEngine(EngineConfig(model=folder, dtype="float32", **overrides))


@pytest.fixture(scope="module")
def folder(hf_checkpoint):
    return hf_checkpoint("llama")[1]


@pytest.fixture(scope="module")
def one_at_a_time(folder):
    engine = make_engine(folder)
    return [engine.generate([p], GREEDY)[0].token_ids for p in PROMPTS]


def run_staggered(engine: LLMEngine, prompts, params, steps_between: int) -> list[list[int]]:
    """Add prompt i after i * steps_between steps, so each joins a batch already running."""
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    pending, step = list(enumerate(prompts)), 0
    while pending or engine.has_unfinished_requests():
        while pending and step >= pending[0][0] * steps_between:
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", prompt, params)
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        step += 1
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def test_all_at_once_equals_one_at_a_time(folder, one_at_a_time):
    together = [c.token_ids for c in make_engine(folder).generate(PROMPTS, GREEDY)]
    assert together == one_at_a_time


def test_staggered_arrivals_equal_one_at_a_time(folder, one_at_a_time):
    engine = make_engine(folder)
    assert run_staggered(engine, PROMPTS, GREEDY, steps_between=3) == one_at_a_time


def test_chunked_prefill_equals_unchunked(folder, one_at_a_time):
    engine = make_engine(folder, max_num_batched_tokens=16, wave_batched_tokens=0)
    assert run_staggered(engine, PROMPTS, GREEDY, steps_between=2) == one_at_a_time


def test_a_wave_of_prompts_takes_larger_steps_with_the_same_output(folder, one_at_a_time):
    """While more prompt tokens are left to compute than the smaller budget takes, a step
    takes up to wave_batched_tokens; after, the smaller one."""
    engine = make_engine(folder, max_num_batched_tokens=16, wave_batched_tokens=64)
    schedule, step_tokens = engine.scheduler.schedule, []

    def recorded(*args, **kwargs):
        batch = schedule(*args, **kwargs)
        step_tokens.append(sum(batch.num_new_tokens))
        return batch

    engine.scheduler.schedule = recorded
    together = [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]

    assert together == one_at_a_time
    # 147 prompt tokens: two steps of 64 (two decodes in the second); then the 21 left (more
    # than 16) in one step, with the decodes of the three prompts through; then steps of 16
    waiting = sum(map(len, PROMPTS))
    assert step_tokens[:2] == [64, 64]
    assert step_tokens[2] == 21 + 3
    assert max(step_tokens[3:]) <= 16
    assert sum(step_tokens) == waiting + len(PROMPTS) * (GREEDY.max_tokens - 1)


def test_shared_prefix_is_served_from_cache_with_identical_output(folder):
    shared = list(range(200, 248))  # three full blocks of 16
    first, second = shared + [1, 2, 3, 4, 5], shared + [9, 8, 7, 6, 5, 4, 3]
    cold = make_engine(folder, enable_prefix_caching=False).generate([second], GREEDY)[0]

    engine = make_engine(folder)
    assert engine.generate([first], GREEDY)[0].num_cached_tokens == 0
    warm = engine.generate([second], GREEDY)[0]

    assert warm.num_cached_tokens == 48
    assert warm.token_ids == cold.token_ids


@pytest.mark.parametrize("length", [32, 40, 300])
def test_repeated_prompt_reuses_all_full_blocks_but_the_last_token(folder, length):
    engine = make_engine(folder)
    # 32: the last token is recomputed, so one block hits
    prompt = [(i * 7) % 370 + 3 for i in range(length)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=True)
    first = engine.generate([prompt], params)[0]
    again = engine.generate([prompt], params)[0]
    assert again.num_cached_tokens == (length - 1) // 16 * 16
    assert again.token_ids == first.token_ids
    # On CPU bit for bit (the batch-invariant kernels: tests/unit/test_invariance.py), so logprobs
    # do not depend on the cache. CUDA's SDPA picks other kernels for a whole prompt and a cached
    # tail (flash, memory-efficient): there, to fp32 rounding.
    if engine.device.type == "cpu":
        assert again.logprobs == first.logprobs
    else:
        torch.testing.assert_close(
            torch.tensor(again.logprobs), torch.tensor(first.logprobs), rtol=1e-5, atol=1e-5
        )


def test_kv_events_report_stored_and_evicted_blocks(folder):
    engine = make_engine(folder, kv_cache_bytes=6 * 8192)  # six blocks
    engine.generate([list(range(1, 34))], SamplingParams(max_tokens=1, temperature=0))
    stored = [h for e in engine.kv.drain_events() if e.kind == "stored" for h in e.block_hashes]
    assert len(stored) == 2  # 33 prompt tokens: two full blocks computed
    # all six blocks
    engine.generate([list(range(100, 196))], SamplingParams(max_tokens=1, temperature=0))
    evicted = [h for e in engine.kv.drain_events() if e.kind == "evicted" for h in e.block_hashes]
    assert set(stored) <= set(evicted)


def test_preemption_when_pool_is_too_small_still_completes_correctly(folder, one_at_a_time):
    # 8 KiB per block; 10 blocks cannot hold five sequences of up to 6 blocks each.
    engine = make_engine(folder, kv_cache_bytes=10 * 8192)
    assert engine.num_blocks == 10
    together = [c.token_ids for c in engine.generate(PROMPTS, GREEDY)]
    assert engine.scheduler.num_preemptions > 0
    assert together == one_at_a_time
    assert engine.num_free_blocks == engine.num_blocks


def test_prefill_export_then_decode_import_equals_colocated(folder, one_at_a_time):
    prefill = make_engine(folder, role="prefill")
    decode = make_engine(folder, role="decode")
    for i, prompt in enumerate(PROMPTS):
        prefill.add_request(f"r{i}", prompt, GREEDY)
    outputs = {o.request_id: o for o in prefill.step() + prefill.step()}
    assert all(o.finish_reason == "prefilled" for o in outputs.values())
    results = {}
    for i in range(len(PROMPTS)):
        kv = outputs[f"r{i}"].kv
        prefill.abort(f"r{i}")  # the KV has moved: its blocks are let go
        reservation = decode.kv.reserve(kv.data.shape[1])
        decode.kv.write(reservation, kv.data)
        first = decode.add(
            AddRequest(
                f"r{i}",
                kv.prompt_token_ids,
                GREEDY,
                FromPrefill(reservation, kv.first_token_id, kv.block_hashes),
            )
        )
        results[f"r{i}"] = list(first.new_token_ids)
    assert prefill.num_free_blocks == prefill.num_blocks
    while decode.has_unfinished_requests():
        for out in decode.step():
            results[out.request_id] += out.new_token_ids
    assert [results[f"r{i}"] for i in range(len(PROMPTS))] == one_at_a_time
    assert decode.num_free_blocks == decode.num_blocks


def test_import_refuses_kv_whose_hashes_are_not_the_prompts(folder):
    decode = make_engine(folder, role="decode")
    prompt = PROMPTS[0]
    reservation = decode.kv.reserve(-(-len(prompt) // decode.config.block_size))
    wrong = [h + 1 for h in hash_blocks(prompt, decode.config.block_size)]
    with pytest.raises(InvalidRequestError, match="hashes"):
        decode.add(AddRequest("r", prompt, GREEDY, FromPrefill(reservation, 1, wrong)))
    # The engine gave the reservation back.
    assert decode.num_free_blocks == decode.num_blocks
    assert decode.num_free_blocks == decode.num_blocks
