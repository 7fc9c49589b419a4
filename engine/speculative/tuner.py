"""How many draft tokens pay, learned from the steps themselves.

Whether a draft token pays depends on the machine, the model and the batch: at batch 1 a
decode step is bound by reading the weights and a few more query tokens are nearly free; at
batch 16 on a CPU they cost compute. So for each batch-size bucket (1, 2, 3-4, 5-8, ...) the
tuner keeps, for each cap on draft tokens per request (0: no speculation, up to k), an
average of the output tokens per second of the decode steps run under that cap, and picks
the best cap. The caps are 0, 1, 2, 4, ... up to k (and k itself): few enough to learn fast.
A bucket starts at 0 and climbs: a cap is first tried only once the cap below it is the best
so far, so a large batch, where drafting costs, never pays for trying large caps. Now and then
a bucket tries the cap above or below the best instead, in turn, so the averages follow a
workload whose acceptance changes: every EXPLORE_EVERY-th step at first, half as often each
time a try confirms the best (down to one in MAX_EXPLORE_EVERY), as often again once a try
finds a better cap. A try (a climb or an exploration) runs TRY_STEPS steps and its first is
not judged: a drafter that sat idle catches up there on every token it missed (a draft
model's KV, an EAGLE-3 head's features), a cost that one-step tries would charge to drafting
as a whole. Only the speed changes with the cap, never the output.
"""

from __future__ import annotations

EXPLORE_EVERY = 16
MAX_EXPLORE_EVERY = 1024
TRY_STEPS = 4  # recorded steps a tried cap runs; the first is not judged
EMA = 0.2  # weight of the newest step


class _Bucket:
    def __init__(self, num_caps: int):
        self.speed: list[float | None] = [None] * num_caps  # output tokens/s per cap
        self.steps = 0
        self.explore_every = EXPLORE_EVERY
        self.next_explore = EXPLORE_EVERY
        self.trying: int | None = None  # the cap index a try is running
        self.exploring = False  # the try is an exploration (not a climb)
        self.tried_steps = 0  # recorded steps of the try so far
        self.num_explored = 0


def caps_up_to(k: int) -> list[int]:
    caps = [0] + [1 << i for i in range(k.bit_length()) if 1 << i < k]
    return caps + [k] if k else caps


class LengthTuner:
    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.caps = caps_up_to(max_tokens)
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket_of(batch_size: int) -> int:
        return (batch_size - 1).bit_length()  # 1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, ...

    def _bucket(self, batch_size: int) -> _Bucket:
        return self._buckets.setdefault(self.bucket_of(batch_size), _Bucket(len(self.caps)))

    def choose(self, batch_size: int) -> int:
        """The cap on draft tokens per request for this step."""
        if self.max_tokens == 0:
            return 0
        bucket = self._bucket(batch_size)
        bucket.steps += 1
        if bucket.trying is None:
            tried = [i for i, speed in enumerate(bucket.speed) if speed is not None]
            best = max(tried, key=lambda i: bucket.speed[i]) if tried else -1
            if best + 1 < len(self.caps) and bucket.speed[best + 1] is None:
                bucket.trying, bucket.exploring = best + 1, False  # climb: the cap below is the best so far
            elif bucket.steps >= bucket.next_explore:
                bucket.next_explore = bucket.steps + bucket.explore_every
                bucket.num_explored += 1
                up = bucket.num_explored % 2 == 1
                neighbour = best + 1 if (up and best + 1 < len(self.caps)) or best == 0 else best - 1
                bucket.trying, bucket.exploring = min(neighbour, len(self.caps) - 1), True
            else:
                return self.caps[best]
            bucket.tried_steps = 0
        return self.caps[bucket.trying]

    def record(self, batch_size: int, cap: int, num_tokens: int, seconds: float) -> None:
        """A decode step (no prompt tokens in it) run under `cap` produced `num_tokens`."""
        if seconds <= 0 or self.max_tokens == 0:
            return
        bucket = self._bucket(batch_size)
        i = self.caps.index(cap)
        if bucket.trying == i:
            bucket.tried_steps += 1
            if bucket.tried_steps == 1:
                return  # the drafter's catch-up step
        speed = num_tokens / seconds
        old = bucket.speed[i]
        bucket.speed[i] = speed if old is None else (1 - EMA) * old + EMA * speed
        if bucket.trying == i and bucket.tried_steps >= TRY_STEPS:
            bucket.trying = None
            if bucket.exploring:  # confirmed the best (explore less) or beat it (explore more)
                best = max(s for s in bucket.speed if s is not None)
                beaten = bucket.speed[i] >= best
                bucket.explore_every = EXPLORE_EVERY if beaten else min(2 * bucket.explore_every,
                                                                        MAX_EXPLORE_EVERY)
