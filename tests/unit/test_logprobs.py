"""Top logprobs: the raw distribution's top-k per token, each request cut to its own k."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.requests import AddRequest, FromPrefill
from engine.sampler import SamplingBatch, sample
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

LOGITS = torch.tensor(
    [
        [2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0],
        [0.3, -1.0, 4.0, 2.5, 0.0, 1.0, -2.0, 0.7],
        [-1.0, 0.0, 1.0, 2.0, 3.0, -4.0, 0.5, 0.25],
    ]
)


def run(*params: SamplingParams):
    seqs = [Sequence(f"s{i}", [0], p, seed=i) for i, p in enumerate(params)]
    batch = SamplingBatch.from_sequences(seqs, LOGITS.shape[-1], torch.device("cpu"))
    return batch, sample(LOGITS[: len(params)], batch)


def test_top_logprobs_are_the_raw_log_softmax_topk():
    # Temperature and filters change the draw, not the reported distribution.
    _, (_, _, (values, ids)) = run(
        SamplingParams(temperature=0, top_logprobs=5),
        SamplingParams(temperature=0.5, top_k=2, top_p=0.5, top_logprobs=5, seed=3),
        SamplingParams(temperature=2.0, min_p=0.3, top_logprobs=5, seed=4),
    )
    expected = LOGITS.log_softmax(-1).topk(5)
    torch.testing.assert_close(values, expected.values)
    assert ids.tolist() == expected.indices.tolist()
    assert ids[0].tolist() == [0, 1, 2, 3, 4]


def test_mixed_batch_computes_the_largest_k_and_only_what_is_asked():
    batch, (_, logprobs, (values, ids)) = run(
        SamplingParams(temperature=0, top_logprobs=3),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, logprobs=True),
    )
    assert batch.top_logprobs == 3 and values.shape == ids.shape == (3, 3)
    torch.testing.assert_close(logprobs, LOGITS.log_softmax(-1).max(-1).values)
    _, (_, logprobs, top) = run(
        SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=True)
    )
    assert logprobs is not None and top is None
    batch, (_, logprobs, top) = run(SamplingParams(temperature=0), SamplingParams(temperature=0.7))
    assert batch.top_logprobs == 0 and logprobs is None and top is None


@pytest.mark.parametrize("k", [21, -1])
def test_top_logprobs_outside_0_to_20_is_refused(k):
    with pytest.raises(InvalidRequestError, match=r"top_logprobs must be in \[0, 20\]"):
        SamplingParams(top_logprobs=k)


def test_top_logprobs_implies_logprobs():
    assert SamplingParams(top_logprobs=20).logprobs and not SamplingParams().logprobs


@pytest.fixture(scope="module")
def folder(hf_checkpoint):
    return hf_checkpoint("llama")[1]


def make_engine(folder: str, **overrides) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=folder, dtype="float32", kv_cache_bytes=8 << 20, **overrides)
    )


def test_engine_reports_each_request_its_own_top_list(folder):
    prompt, n = [4, 8, 15, 16, 23, 42], 6
    top3, plain, only_logprobs, sampled = make_engine(folder).generate(
        [prompt] * 4,
        [
            SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, top_logprobs=3),
            SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
            SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=True),
            SamplingParams(max_tokens=n, temperature=1.0, seed=7, ignore_eos=True, top_logprobs=20),
        ],
    )
    assert plain.logprobs is None and plain.top_logprobs is None
    assert only_logprobs.top_logprobs is None and len(only_logprobs.logprobs) == n
    assert top3.token_ids == plain.token_ids == only_logprobs.token_ids
    assert top3.logprobs == pytest.approx(only_logprobs.logprobs, abs=1e-5)
    assert len(top3.top_logprobs) == len(sampled.top_logprobs) == n
    for token, logprob, top in zip(top3.token_ids, top3.logprobs, top3.top_logprobs):
        assert len(top) == 3 and [lp for _, lp in top] == sorted(
            (lp for _, lp in top), reverse=True
        )
        assert top[0] == (token, logprob)  # greedy: the chosen token is the top one, same value
    for token, logprob, top in zip(sampled.token_ids, sampled.logprobs, sampled.top_logprobs):
        assert len(top) == 20 and logprob <= top[0][1]
        assert dict(top).get(token, logprob) == logprob


def test_imported_first_token_has_no_logprobs_then_decode_reports_them(folder):
    decode = make_engine(folder, role="decode")
    prompt, params = (
        list(range(10, 47)),
        SamplingParams(max_tokens=3, temperature=0, top_logprobs=2),
    )
    reservation = decode.kv.reserve(-(-len(prompt) // decode.config.block_size))
    first = decode.add(AddRequest("r", prompt, params, FromPrefill(reservation, 5)))
    assert first.new_logprobs == [None] and first.new_top_logprobs == [[]]
    (out,) = decode.step()
    (top,) = out.new_top_logprobs
    assert len(top) == 2 and top[0] == (out.new_token_ids[0], out.new_logprobs[0])
    decode.abort("r")
