"""Prices per token kind, and the cost of a request's usage.

`--prices input:0.60,cached_input:0.10,output:3.00` (USD per million tokens; `PRICES=` in
`make run`). With prices set, every usage reports
    cost = ((prompt_tokens - cached_tokens) x input + cached_tokens x cached_input
            + completion_tokens x output) / 1e6
and `cost_details` with each of the three terms; without them neither field appears. Cached
prompt tokens are the ones a worker's prefix cache served: billed at the discounted rate.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.gateway.protocol import Usage

KINDS = ("input", "cached_input", "output")


@dataclass(frozen=True)
class Prices:
    input: float
    cached_input: float
    output: float

    @staticmethod
    def parse(text: str) -> Prices | None:
        """`input:0.60,cached_input:0.10,output:3.00`; empty: no prices. Raises ValueError."""
        if not text.strip():
            return None
        values = {}
        for item in text.split(","):
            kind, _, price = item.strip().partition(":")
            if kind not in KINDS:
                raise ValueError(
                    f"--prices: unknown kind {kind!r}; give {', '.join(KINDS)} (USD per million tokens)"
                )
            try:
                values[kind] = float(price)
            except ValueError:
                raise ValueError(f"--prices: {kind} has no number ({item.strip()!r})") from None
            if values[kind] < 0:
                raise ValueError(f"--prices: {kind} must not be negative")
        missing = [k for k in KINDS if k not in values]
        if missing:
            raise ValueError(f"--prices: missing {', '.join(missing)}")
        return Prices(**values)

    def cost_details(self, usage: Usage) -> dict[str, float]:
        return {
            "input": (usage.prompt_tokens - usage.cached_tokens) * self.input / 1e6,
            "cached_input": usage.cached_tokens * self.cached_input / 1e6,
            "output": usage.completion_tokens * self.output / 1e6,
        }

    def cost(self, usage: Usage) -> float:
        return (
            (usage.prompt_tokens - usage.cached_tokens) * self.input
            + usage.cached_tokens * self.cached_input
            + usage.completion_tokens * self.output
        ) / 1e6
