"""Speculative decoding in the engine: lossless against plain decoding (greedy and seeded
sampling, with right, wrong and prompt-lookup drafts), several tokens a step with stops,
max_tokens and logprobs holding, rejected drafts never cached and every block returned,
rejection sampling with draft probabilities following the target's distribution, a model
drafter's draws following its q (and kept whole when the draft is the target itself), and the
drafters' lookups (own context, recent requests, a prediction after an edit)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from engine.block_hash import hash_blocks
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.speculative import create_drafter
from engine.speculative.base import Draft, Drafter
from engine.speculative.draw import TOP_Q, draw
from engine.speculative.ngram import NgramDrafter, NgramIndex
from engine.speculative.prediction import PredictionDrafter
from engine.speculative.tuner import EARLY_PAIRS, TRY_PAIRS, LengthTuner
from engine.speculative.verify import rejection_sample

PROMPTS = [
    [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7],  # repeats: prompt lookup finds matches
    list(range(3, 40)),
    [11, 12, 13] * 8,
    [17],
]


class Oracle(Drafter):
    """Proposes the known continuation, except every `wrong_every`-th proposal, whose tokens are all wrong."""

    def __init__(self, answers: dict[tuple, list[int]], wrong_every: int = 0):
        self.answers, self.wrong_every, self.calls = answers, wrong_every, 0

    def propose(self, seqs, max_tokens):
        drafts = []
        for seq, k in zip(seqs, max_tokens):
            self.calls += 1
            answer = self.answers[tuple(seq.token_ids[: seq.num_prompt_tokens])]
            right = answer[seq.num_output_tokens : seq.num_output_tokens + k]
            wrong = self.wrong_every and self.calls % self.wrong_every == 0
            drafts.append(Draft([(t + 1) % 300 for t in right] if wrong else right))
        return drafts


class Noise(Drafter):
    """Random tokens: almost every draft is rejected."""

    def __init__(self, vocab_size: int = 300):
        self.rng, self.vocab_size = random.Random(0), vocab_size

    def propose(self, seqs, max_tokens):
        return [Draft([self.rng.randrange(self.vocab_size) for _ in range(k)]) for k in max_tokens]


@pytest.fixture(scope="module")
def checkpoint(hf_checkpoint):
    return hf_checkpoint("llama")[1]


def engine_with(checkpoint, drafter=None, k=4, **kwargs) -> LLMEngine:
    engine = LLMEngine(
        EngineConfig(
            model=checkpoint,
            dtype="float32",
            kv_cache_bytes=4 << 20,
            num_speculative_tokens=k,
            **kwargs,
        )
    )
    engine.speculator.drafter = drafter
    # these tests verify drafts, not tune their length
    engine.speculator.tuner.choose = lambda batch_size: k
    return engine


def run(engine: LLMEngine, params) -> list:
    return engine.generate(PROMPTS, params)


GREEDY = SamplingParams(
    max_tokens=40, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=2
)
SAMPLED = [
    SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=s, ignore_eos=True)
    for s in range(4)
]


@pytest.fixture(scope="module")
def plain(checkpoint):
    engine = engine_with(checkpoint)
    return {"greedy": run(engine, GREEDY), "sampled": run(engine, SAMPLED)}


def answers(results) -> dict[tuple, list[int]]:
    return {tuple(p): r.token_ids for p, r in zip(PROMPTS, results)}


@pytest.mark.parametrize("which", ["greedy", "sampled"])
@pytest.mark.parametrize(
    "drafter", ["ngram", "draft-model", "oracle", "oracle-sometimes-wrong", "noise"]
)
def test_output_equals_plain_decoding_token_for_token(checkpoint, plain, which, drafter):
    params = GREEDY if which == "greedy" else SAMPLED
    make = {
        "ngram": NgramDrafter,
        "noise": Noise,
        "draft-model": lambda: create_drafter(
            "draft", engine_with(checkpoint), draft_model=checkpoint
        ),
        "oracle": lambda: Oracle(answers(plain[which])),
        "oracle-sometimes-wrong": lambda: Oracle(answers(plain[which]), wrong_every=3),
    }[drafter]
    engine = engine_with(checkpoint, make())
    results = run(engine, params)
    assert [r.token_ids for r in results] == [r.token_ids for r in plain[which]]
    if (drafter, which) != ("ngram", "sampled"):  # a tiny random model's samples rarely repeat
        assert engine.speculator.num_drafted > 0
    if drafter.startswith("oracle") or (drafter, which) == (
        "draft-model",
        "greedy",
    ):  # the target as its own draft
        assert engine.speculator.num_accepted > engine.speculator.num_drafted / 2
    if which == "greedy":
        for got, want in zip(results, plain[which]):
            assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
            assert [[t for t, _ in top] for top in got.top_logprobs] == [
                [t for t, _ in top] for top in want.top_logprobs
            ]


def test_several_tokens_a_step_stop_at_a_stop_token_and_at_max_tokens(checkpoint, plain):
    greedy = plain["greedy"]
    # ends prompt 1 at its 10th token (or earlier, if it came before)
    stop_at = greedy[1].token_ids[9]
    params = [
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=[stop_at]),
        SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
    ]
    prompts = [PROMPTS[1], PROMPTS[0]]
    want = engine_with(checkpoint).generate(prompts, params)
    engine = engine_with(checkpoint, Oracle(answers(greedy)), k=6)
    got = engine.generate(prompts, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert got[0].token_ids[-1] == stop_at and got[0].finish_reason == "stop"
    assert len(got[1].token_ids) == 7 and got[1].finish_reason == "length"
    assert engine.speculator.num_accepted >= 5  # tokens did arrive several a step


def test_rejected_drafts_are_never_cached_and_every_block_comes_back(checkpoint, plain):
    engine = engine_with(checkpoint, Noise(), k=8)
    results = run(engine, GREEDY)
    assert (
        engine.speculator.num_drafted > 100
        and engine.speculator.num_accepted < engine.speculator.num_drafted / 4
    )
    bs = engine.config.block_size
    real = {h for p, r in zip(PROMPTS, results) for h in hash_blocks(p + r.token_ids, bs)}
    assert set(engine.block_manager.hash_to_block) <= real  # only blocks of real tokens
    assert engine.num_free_blocks == engine.num_blocks
    assert not engine.seqs and not engine.speculator._records


def test_a_draft_model_lets_go_of_its_blocks_when_requests_end(checkpoint):
    engine = engine_with(checkpoint)
    engine.speculator.drafter = drafter = create_drafter("draft", engine, draft_model=checkpoint)
    run(engine, GREEDY)
    assert drafter.blocks.num_free_blocks == drafter.blocks.num_blocks and not drafter._seqs


def test_a_prediction_drafts_for_its_request_only(checkpoint, plain):
    greedy = plain["greedy"]
    engine = engine_with(checkpoint)  # no drafter configured
    params = [
        SamplingParams(
            max_tokens=40, temperature=0, ignore_eos=True, prediction=greedy[1].token_ids
        ),
        GREEDY,
    ]
    results = engine.generate([PROMPTS[1], PROMPTS[2]], params)
    assert [r.token_ids for r in results] == [greedy[1].token_ids, greedy[2].token_ids]
    # the exact reply: all kept
    assert engine.speculator.num_accepted == engine.speculator.num_drafted > 30


def test_rejection_sampling_with_draft_probabilities_follows_the_target():
    vocab = 6
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 0.3, -1.0], [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]])
    q = torch.tensor([[0.05, 0.05, 0.5, 0.3, 0.05, 0.05]])  # a poor draft distribution
    params = SamplingParams(temperature=1.0)
    n = 6000
    first = torch.zeros(vocab)
    rng = torch.Generator().manual_seed(0)
    for i in range(n):
        draft = [int(torch.multinomial(q[0], 1, generator=rng))]
        tokens = rejection_sample(logits, Sequence(f"r{i}", [0], params, seed=i), draft, q)
        first[tokens[0]] += 1
    expected = logits[0].softmax(-1) * n
    chi2 = ((first - expected) ** 2 / expected).sum().item()
    dof = vocab - 1
    assert chi2 < dof + 6 * math.sqrt(2 * dof) + 10, (chi2, first.tolist(), expected.tolist())


def test_unseeded_sampled_requests_draw_their_drafts_from_q_and_the_rest_take_the_argmax():
    vocab = 40
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(1)) * 2
    unseeded = Sequence("u", [0], SamplingParams(temperature=0.8, top_k=12), seed=0)
    seeded = Sequence("s", [0], SamplingParams(temperature=0.8, top_k=12, seed=3), seed=3)
    greedy = Sequence("g", [0], SamplingParams(temperature=0), seed=0)
    n, counts = 4000, torch.zeros(vocab)
    for i in range(n):
        unseeded.seed = i
        tokens, qs = draw(logits.expand(3, vocab), [greedy, unseeded, seeded], [5, 5 + i % 7, 5])
        assert set(qs) == {1} and tokens[0] == tokens[2] == logits.argmax()
        ids, q = qs[1]
        assert len(ids) == TOP_Q and q[ids == tokens[1]].item() > 0
        counts[tokens[1]] += 1
    expected = (logits[0] / 0.8).softmax(-1)
    expected[expected < expected.topk(12).values[-1]] = 0  # the request's own top-k
    expected = expected / expected.sum() * n
    kept = expected > 0
    assert counts[~kept].sum() == 0
    chi2 = ((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum().item()
    dof = int(kept.sum()) - 1
    assert chi2 < dof + 6 * math.sqrt(2 * dof) + 10, (chi2, counts.tolist(), expected.tolist())


def test_a_draft_model_drawing_with_q_has_its_drafts_kept_where_it_is_the_target(checkpoint):
    """q = p exactly: rejection sampling keeps every draft, where one-hot drafts keep only p(x)."""
    unseeded = SamplingParams(max_tokens=30, temperature=1.0, top_k=8, ignore_eos=True)
    engine = engine_with(checkpoint)
    engine.speculator.drafter = drafter = create_drafter("draft", engine, draft_model=checkpoint)
    results = run(engine, unseeded)
    assert all(len(r.token_ids) == 30 for r in results)
    assert engine.speculator.num_accepted == engine.speculator.num_drafted > 50
    assert engine.num_free_blocks == engine.num_blocks and not drafter._seqs
    engine = engine_with(checkpoint)  # the same settings with seeds: one-hot drafts, most rejected
    engine.speculator.drafter = create_drafter("draft", engine, draft_model=checkpoint)
    run(
        engine,
        [
            SamplingParams(max_tokens=30, temperature=1.0, top_k=8, ignore_eos=True, seed=s)
            for s in range(4)
        ],
    )
    assert engine.speculator.num_accepted < 0.8 * engine.speculator.num_drafted


def test_the_ngram_index_finds_the_last_earlier_occurrence_of_the_longest_tail():
    rng = random.Random(1)
    tokens = [rng.randrange(6) for _ in range(300)]
    index = NgramIndex((2, 3, 4))
    for upto in (50, 51, 180, 299):  # grown in steps, as a sequence grows
        index.extend(tokens, upto)
    for n in (4, 3, 2):  # the tail itself ends at len(tokens), past everything indexed
        ends = [e for e in range(n, len(tokens)) if tokens[e - n : e] == tokens[-n:]]
        if ends:
            assert index.follow(tokens) == (ends[-1], n)
            break
    else:
        raise AssertionError("no tail n-gram occurs earlier: pick another seed")


def test_prompt_lookup_drafts_from_earlier_requests_outputs():
    drafter = NgramDrafter()
    params = SamplingParams(max_tokens=50)
    first = Sequence("a", [1, 2, 3], params, seed=0)
    first.token_ids += [40, 41, 42, 43, 44, 45]
    drafter.propose([first], [4])
    drafter.forget("a")  # its output joins the shared history
    second = Sequence("b", [9, 9, 9], params, seed=0)
    second.token_ids += [41, 42]
    assert drafter.propose([second], [3])[0].token_ids == [43, 44, 45]


def test_a_reply_is_drafted_from_its_first_token_after_the_same_prompt_tail():
    # Two chats whose prompts end alike (an assistant header): the second reply's opening is
    # drafted before it has a token of its own, and a longer context picks the right source.
    drafter = NgramDrafter()
    params = SamplingParams(max_tokens=50)
    header = [7, 8, 9]
    first = Sequence("a", [1, 2, 3, 5, 6, *header], params, seed=0)
    first.token_ids += [40, 41, 42, 43]
    drafter.propose([first], [4])
    drafter.forget("a")
    second = Sequence("b", [4, 4, 40, 41, 99, 5, 6, *header], params, seed=0)
    assert drafter.propose([second], [4])[0].token_ids == [40, 41, 42, 43]


def test_a_prediction_finds_its_place_again_after_an_edit():
    drafter = PredictionDrafter()
    prediction = [10, 11, 12, 13, 14, 15, 16, 17]
    seq = Sequence("p", [1], SamplingParams(max_tokens=50, prediction=prediction), seed=0)
    assert drafter.propose([seq], [3])[0].token_ids == [10, 11, 12]
    seq.token_ids += [10, 11, 99, 13]  # an edit at 12, then back on the prediction
    assert drafter.propose([seq], [3])[0].token_ids == [14, 15, 16]


def tune(tuner: LengthTuner, speed, steps: int, batch_sizes=(1, 16)) -> dict[int, list[int]]:
    """The caps the tuner chooses over `steps` steps per batch size, timed by speed(batch_size,
    cap, previous cap)."""
    chosen = {b: [0] for b in batch_sizes}
    for _ in range(steps):
        for batch_size in batch_sizes:
            cap = tuner.choose(batch_size)
            tuner.record(batch_size, cap, 1, 1 / speed(batch_size, cap, chosen[batch_size][-1]))
            chosen[batch_size].append(cap)
    return chosen


def test_the_tuner_climbs_where_drafting_pays_and_stays_off_where_it_costs():
    def speed(
        batch_size: int, cap: int, _
    ) -> float:  # batch 1: each draft token pays; batch 16: each costs
        return 100 * (1 + 0.5 * cap) if batch_size == 1 else 100 / (1 + 0.5 * cap)

    chosen = tune(LengthTuner(8), speed, 600)
    assert chosen[1][-20:].count(8) >= 16  # the largest cap, but for an odd try of another
    assert chosen[16][-20:].count(0) >= 16 and max(chosen[16]) == 1  # 2 and more were never tried
    # tries that keep confirming the best grow rare
    assert chosen[16][-300:].count(1) <= 2 * (1 + TRY_PAIRS)


def test_the_tuner_judges_throughput_when_a_larger_cap_yields_tokens_unevenly():
    """Prompt lookup at batch 1: cap 1 keeps 2 tokens every step; cap 2 keeps 9 on one step
    in five and 1 on the others (2.6 on average), each step taking the same time. Cap 2 has
    1.3x the throughput, though the geometric mean of six pairs' speed ratios is 0.72 with
    one 9 among them."""
    tuner, chosen, turn = LengthTuner(2), [], 0
    for _ in range(400):
        cap = tuner.choose(1)
        if cap == 2:
            turn += 1
        tokens = {0: 1, 1: 2, 2: 9 if turn % 5 == 0 else 1}[cap]
        tuner.record(1, cap, tokens, 0.001)
        chosen.append(cap)
    assert chosen[-50:].count(2) >= 40


def test_a_drafter_that_catches_up_after_sitting_idle_is_judged_on_its_drafting():
    """The first step with drafts after three or more without is 10x slower (a draft model
    catching up on every token it missed); one idle step costs it nothing more."""

    def speed(cap: int, idle: int) -> float:
        drafting = 100 * (1 + 0.5 * cap)
        return drafting / 10 if cap and idle >= 3 else drafting

    tuner, chosen, idle = LengthTuner(8), [], 100
    for _ in range(300):
        cap = tuner.choose(1)
        tuner.record(1, cap, 1, 1 / speed(cap, idle))
        idle = 0 if cap else idle + 1
        chosen.append(cap)
    assert chosen[-20:].count(8) >= 16


def test_a_try_that_clearly_loses_ends_early_and_one_that_is_close_runs_whole():
    """Starting high (the step threads' tuner: 1 borrows), the try of cap 0 comes at once: at
    half the speed it ends after its catch-up step and EARLY_PAIRS pairs; at 0.9x it runs all
    TRY_PAIRS. Either way cap 1 stays, and the next try waits."""
    for speed_of_0, pairs in [(0.5, EARLY_PAIRS), (0.9, TRY_PAIRS)]:
        tuner, chosen = LengthTuner(1, start_high=True), []
        for _ in range(40):
            cap = tuner.choose(64)
            tuner.record(64, cap, 64, 64 / (100 * (1.0 if cap else speed_of_0)))
            chosen.append(cap)
        try_steps = 2 * pairs + 2  # the catch-up, its pair's best step, then the judged pairs
        assert chosen[:try_steps] == [0, 1] * (pairs + 1)
        assert set(chosen[try_steps : try_steps + 30]) == {1}


def test_the_tuner_is_not_fooled_by_a_batch_that_shrinks_or_by_noise():
    """Within one bucket (9-16) the batch shrinks as requests finish and refills, and every
    step's time is off by up to 25%: drafting that costs 8% stays off, and drafting that gains
    30% is found."""

    def run(gain: float, seed: int) -> list[int]:
        rng, tuner, chosen = random.Random(seed), LengthTuner(8), []
        for step in range(1200):
            batch_size = 16 - (step // 10) % 8  # 16 down to 9, ten steps each, again and again
            cap = tuner.choose(batch_size)
            tokens_s = 40 * batch_size * (gain if cap else 1.0) * rng.uniform(0.75, 1.25)
            tuner.record(batch_size, cap, batch_size, batch_size / tokens_s)
            chosen.append(cap)
        return chosen

    seeds = range(4)
    assert sum(run(0.92, seed)[-600:].count(0) for seed in seeds) >= 0.9 * 600 * len(seeds)
    assert sum(run(1.3, seed)[-600:].count(0) for seed in seeds) <= 0.05 * 600 * len(seeds)
