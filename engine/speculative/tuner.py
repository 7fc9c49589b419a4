"""How many draft tokens pay, learned from the steps themselves.

Whether a draft token pays depends on the machine, the model and the batch: at batch 1 a
decode step is bound by reading the weights and a few more query tokens are nearly free; at
batch 16 on a CPU they cost compute. So for each batch-size bucket (1, 2, 3-4, 5-8, ...) the
tuner keeps, for each cap on draft tokens per request (0: no speculation, up to k), an
average of the output tokens per second of the decode steps run under that cap, and picks
the best cap. The caps are 0, 1, 2, 4, ... up to k (and k itself): few enough to learn fast.
A bucket starts at 0 and climbs: a cap is first tried only once the cap below it is the best
so far, so a large batch, where drafting costs, never pays for trying large caps. Now and then a step
of a bucket tries the cap above or below the best instead, in turn, so the averages follow a
workload whose acceptance changes: every EXPLORE_EVERY-th step at first, half as often each
time a try confirms the best (down to one in MAX_EXPLORE_EVERY), as often again once a try
finds a better cap. Only the speed changes with the cap, never the output.
"""

from __future__ import annotations

EXPLORE_EVERY = 16
MAX_EXPLORE_EVERY = 1024
EMA = 0.2  # weight of the newest step


class _Bucket:
    def __init__(self, num_caps: int):
        self.speed: list[float | None] = [None] * num_caps  # output tokens/s per cap
        self.steps = 0
        self.explore_every = EXPLORE_EVERY
        self.next_explore = EXPLORE_EVERY
        self.explored: int | None = None  # the cap index a step is trying
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

    def choose(self, batch_size: int) -> int:
        """The cap on draft tokens per request for this step."""
        if self.max_tokens == 0:
            return 0
        bucket = self._buckets.setdefault(self.bucket_of(batch_size), _Bucket(len(self.caps)))
        bucket.steps += 1
        tried = [i for i, speed in enumerate(bucket.speed) if speed is not None]
        if not tried:
            return 0
        best = max(tried, key=lambda i: bucket.speed[i])
        if best + 1 < len(self.caps) and bucket.speed[best + 1] is None:
            return self.caps[best + 1]  # climb: the cap below is the best so far
        if bucket.steps >= bucket.next_explore:
            bucket.next_explore = bucket.steps + bucket.explore_every
            bucket.num_explored += 1
            up = bucket.num_explored % 2 == 1
            neighbour = best + 1 if (up and best + 1 < len(self.caps)) or best == 0 else best - 1
            bucket.explored = min(neighbour, len(self.caps) - 1)
            return self.caps[bucket.explored]
        return self.caps[best]

    def record(self, batch_size: int, cap: int, num_tokens: int, seconds: float) -> None:
        """A decode step (no prompt tokens in it) run under `cap` produced `num_tokens`."""
        if seconds <= 0 or self.max_tokens == 0:
            return
        bucket = self._buckets.setdefault(self.bucket_of(batch_size), _Bucket(len(self.caps)))
        i = self.caps.index(cap)
        speed = num_tokens / seconds
        old = bucket.speed[i]
        bucket.speed[i] = speed if old is None else (1 - EMA) * old + EMA * speed
        if bucket.explored == i:  # a try: confirmed the best (explore less) or beat it (explore more)
            bucket.explored = None
            best = max(s for s in bucket.speed if s is not None)
            beaten = bucket.speed[i] >= best
            bucket.explore_every = EXPLORE_EVERY if beaten else min(2 * bucket.explore_every, MAX_EXPLORE_EVERY)
