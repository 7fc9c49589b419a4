"""How many draft tokens pay, learned from the steps themselves.

Whether a draft token pays depends on the machine, the model and the batch: at batch 1 a
decode step is bound by reading the weights and a few more query tokens are nearly free; at
batch 16 on a CPU they cost compute. So for each batch-size bucket (1, 2, 3-4, 5-8, ...) the
tuner keeps a best cap on draft tokens per request (0, no speculation, up to k; the caps are
0, 1, 2, 4, ... up to k, few enough to learn fast) and now and then tries another against it.

A try is a paired comparison: the candidate cap and the best take turns, step by step, for
TRY_PAIRS pairs, and the candidate wins on its speed over the best's, each side's output tokens
over its seconds summed across the pairs: throughput, not a mean of per-step ratios, whose
logs penalise the larger cap's wider spread of tokens per step (a prompt-lookup step yields
1 token or 9). Neighbouring steps share their batch size, context
lengths and the machine's load, so a batch that shrinks as requests finish, or a noisy
neighbour, moves both sides of a pair alike: only the cap differs. A larger cap must win by
MARGIN (drafting is the risk); a smaller one wins unless it loses by MARGIN. A candidate
CLEAR_LOSS behind after EARLY_PAIRS pairs loses then (the step threads' try of one thread at
batch 64 ran 0.6x as fast: six pairs of it cost 3% of a serving run). The first step of
a try is not judged: a drafter that sat idle catches up there on every token it missed (a
draft model's KV, an EAGLE-3 head's features), a cost the alternating steps then no longer pay.
That step can cost many (a draft model prefilling every prompt of the batch), so the next
exploration waits until the bucket has run 1 / EXPLORE_SHARE times as long.

A bucket starts at 0 and climbs while each larger cap wins, so a large batch, where drafting
costs, only ever pays for trying cap 1. Batch 1 starts at the largest cap and is tried
downwards: there a step reads every weight once for a few query tokens, so drafting is
nearly free, and a climb through every cap cost prompt lookup a third of its gain on tool
calls (its early tries, on few steps, judged uneven yields); `start_high` starts every bucket
there (the step threads: borrowing pays on a real model). Then it explores the cap above and
below the best in turn, every EXPLORE_EVERY steps at first, half as often each time the best
holds (down to one in MAX_EXPLORE_EVERY); a try that wins goes on the same way at once and
brings the explorations back to every EXPLORE_EVERY steps, so a workload whose acceptance
changes is followed within a few tries. Only the speed changes with the cap, never the output.
"""

from __future__ import annotations

EXPLORE_EVERY = 16
MAX_EXPLORE_EVERY = 1024
TRY_PAIRS = 6  # judged (candidate, best) step pairs in a try
MARGIN = 0.03
EARLY_PAIRS = 2
CLEAR_LOSS = 0.25
# at most this share of a bucket's time goes to the catch-up steps of its tries
EXPLORE_SHARE = 0.05


class _Try:
    def __init__(self, candidate: int):
        self.candidate = candidate
        self.steps = 0  # chosen so far
        # the candidate's (tokens, seconds), waiting for the best's step
        self.pending: tuple[int, float] | None = None
        self.num_pairs = 0
        self.candidate_sums = [0, 0.0]  # tokens, seconds over the judged pairs
        self.best_sums = [0, 0.0]


class _Bucket:
    def __init__(self, best: int = 0):
        self.best = best  # index into caps
        self.steps = 0
        self.explore_every = EXPLORE_EVERY
        self.next_explore = 0  # the first try (a climb from 0) starts at once
        self.num_explored = 0
        self.trying: _Try | None = None
        self.seconds = 0.0  # recorded step time
        self.quiet_until = 0.0  # no exploration before `seconds` reaches this


def caps_up_to(k: int) -> list[int]:
    caps = [0] + [1 << i for i in range(k.bit_length()) if 1 << i < k]
    return caps + [k] if k else caps


class LengthTuner:
    def __init__(self, max_tokens: int, start_high: bool = False):
        self.max_tokens = max_tokens
        self.caps = caps_up_to(max_tokens)
        self.start_high = start_high
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket_of(batch_size: int) -> int:
        return (batch_size - 1).bit_length()  # 1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, ...

    def _bucket(self, batch_size: int) -> _Bucket:
        key = self.bucket_of(batch_size)
        if key not in self._buckets:
            high = key == 0 or self.start_high
            self._buckets[key] = _Bucket(best=len(self.caps) - 1 if high else 0)
        return self._buckets[key]

    def choose(self, batch_size: int) -> int:
        """The cap on draft tokens per request for this step."""
        if self.max_tokens == 0:
            return 0
        bucket = self._bucket(batch_size)
        bucket.steps += 1
        if (
            bucket.trying is None
            and bucket.steps >= bucket.next_explore
            and bucket.seconds >= bucket.quiet_until
        ):
            bucket.trying = self._next_try(bucket)
        attempt = bucket.trying
        if attempt is None:
            return self.caps[bucket.best]
        attempt.steps += 1
        # Step 1 (the catch-up) and then every odd step run the candidate; even steps the best.
        return self.caps[attempt.candidate if attempt.steps % 2 == 1 else bucket.best]

    def _next_try(self, bucket: _Bucket) -> _Try | None:
        if bucket.steps == 1 and bucket.best == 0:  # a new bucket climbs from 0
            return _Try(1) if len(self.caps) > 1 else None
        bucket.num_explored += 1
        up = bucket.num_explored % 2 == 1
        if (up and bucket.best + 1 < len(self.caps)) or bucket.best == 0:
            candidate = bucket.best + 1
        else:
            candidate = bucket.best - 1
        return _Try(candidate) if 0 <= candidate < len(self.caps) else None

    def record(self, batch_size: int, cap: int, num_tokens: int, seconds: float) -> None:
        """A decode step (no prompt tokens in it) run under `cap` produced `num_tokens`."""
        if seconds <= 0 or self.max_tokens == 0:
            return
        bucket = self._bucket(batch_size)
        bucket.seconds += seconds
        attempt = bucket.trying
        if (
            attempt is not None and attempt.steps == 1
        ):  # the catch-up: the next try waits for it to pay
            bucket.quiet_until = bucket.seconds + seconds / EXPLORE_SHARE
        if attempt is None or attempt.steps < 2:
            return
        if cap == self.caps[attempt.candidate] and attempt.steps % 2 == 1:
            attempt.pending = (num_tokens, seconds)
        elif cap == self.caps[bucket.best] and attempt.pending is not None:
            for sums, (tokens, secs) in (
                (attempt.candidate_sums, attempt.pending),
                (attempt.best_sums, (num_tokens, seconds)),
            ):
                sums[0] += tokens
                sums[1] += secs
            attempt.num_pairs += 1
            attempt.pending = None
        if attempt.num_pairs >= TRY_PAIRS or (
            attempt.num_pairs >= EARLY_PAIRS and self._ratio(attempt) < 1 - CLEAR_LOSS
        ):
            self._judge(bucket, attempt)

    @staticmethod
    def _ratio(attempt: _Try) -> float:
        """The candidate's speed over the best's, over the judged pairs."""
        (c_tokens, c_secs), (b_tokens, b_secs) = attempt.candidate_sums, attempt.best_sums
        return (c_tokens / c_secs) / (b_tokens / b_secs) if b_tokens else 1.0

    def _judge(self, bucket: _Bucket, attempt: _Try) -> None:
        ratio = self._ratio(attempt)
        step = attempt.candidate - bucket.best  # +1: a larger cap, -1: a smaller one
        won = ratio > 1 + MARGIN if step > 0 else ratio > 1 - MARGIN
        bucket.trying = None
        if won:
            bucket.best = attempt.candidate
            bucket.explore_every = EXPLORE_EVERY
        else:
            bucket.explore_every = min(2 * bucket.explore_every, MAX_EXPLORE_EVERY)
        if won and 0 <= bucket.best + step < len(self.caps):
            bucket.trying = _Try(bucket.best + step)  # a win goes on the same way at once
        else:
            bucket.next_explore = bucket.steps + bucket.explore_every
