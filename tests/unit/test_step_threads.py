"""A step that fills the token budget also computes on the borrowed CPUs, on a thread pinned
there, with the same tokens and logprobs as without borrowing (engine/step_threads.py)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

DEMO = os.path.join(os.path.dirname(__file__), "..", "..", "demo", "tandem-demo")
PROMPT = [(7 * i) % 2000 + 100 for i in range(150)]

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")


def run_in_thread(fn):
    """On a thread of its own, as the worker's engine loop: its OpenMP pool ends with it."""
    out = {}
    thread = threading.Thread(target=lambda: out.update(value=fn()))
    thread.start()
    thread.join()
    return out["value"]


def test_a_full_step_borrows_a_pinned_thread_and_keeps_the_bits():
    own, borrowed = sorted(os.sched_getaffinity(0))[:2]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, top_logprobs=2)
    threads = torch.get_num_threads()

    def generate(borrowed_cpus: str):
        config = EngineConfig(
            model=DEMO, cpu_threads=1, max_num_batched_tokens=64, borrowed_cpus=borrowed_cpus
        )
        engine = LLMEngine(config)
        out = engine.generate([PROMPT], params)[0]
        helpers = engine.step_threads._helpers if engine.step_threads else None
        pinned = [os.sched_getaffinity(tid) for tid in helpers or ()]
        return out, helpers, pinned

    try:
        alone, none, _ = run_in_thread(lambda: generate(""))
        lent, helpers, pinned = run_in_thread(lambda: generate(str(borrowed)))
    finally:
        torch.set_num_threads(threads)
    assert none is None
    assert helpers and pinned == [{borrowed}] * len(helpers), (own, borrowed, pinned)
    assert (lent.token_ids, lent.logprobs, lent.top_logprobs) == (
        alone.token_ids,
        alone.logprobs,
        alone.top_logprobs,
    )


def test_steps_with_prompt_tokens_borrow_from_a_size_up(monkeypatch):
    """A wave fills the budget; any step with prompt tokens in it (prompts alone, or beside
    decodes that stream) borrows from PROMPT_STEP_TOKENS up; a smaller one does not."""
    from engine import step_threads

    threads = step_threads.StepThreads(own=1, borrowed=[0], min_tokens=512)
    monkeypatch.setattr(threads, "_make_helpers", lambda: set())
    counts = []
    monkeypatch.setattr(torch, "set_num_threads", counts.append)
    least = step_threads.PROMPT_STEP_TOKENS
    for tokens in [least, least - 1, 512, least + 300, 8]:
        threads.fit(tokens)
    assert counts == [2, 1, 2, 1]  # least + 300 after 512: still borrowing, nothing to set


@pytest.mark.parametrize("borrowing_pays", [True, False])
def test_decode_steps_learn_whether_borrowing_pays(monkeypatch, borrowing_pays):
    """Decodes alone, batch 4 (a bucket that starts borrowing): steps on two threads take half
    as long, or twice as long; the tuner settles on the faster, and a step with prompts in it
    never borrows below the rule's sizes."""
    from engine import step_threads

    threads = step_threads.StepThreads(own=1, borrowed=[0], min_tokens=512)
    monkeypatch.setattr(threads, "_make_helpers", lambda: set())
    counts = []
    monkeypatch.setattr(torch, "set_num_threads", counts.append)
    seconds = {1: 0.02, 2: 0.01 if borrowing_pays else 0.04}
    for _ in range(200):
        threads.fit(4, decode_batch=4)
        threads.record(4, seconds[threads._current])
    settled = threads._current
    assert settled == (2 if borrowing_pays else 1)
    threads.fit(8)  # decodes with a prompt chunk: the rule only
    assert threads._current == 1
    tried = set(counts)
    assert tried == {1, 2}  # both were tried either way
