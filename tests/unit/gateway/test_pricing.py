"""Prices: parsing, and the cost formula."""

from __future__ import annotations

import pytest

from services.gateway.pricing import Prices
from services.gateway.protocol import Usage


def test_parse_and_cost():
    prices = Prices.parse("input:0.60, cached_input:0.10,output:3")
    usage = Usage(prompt_tokens=1000, completion_tokens=100, cached_tokens=800)
    assert prices.cost_details(usage) == {
        "input": 200 * 0.60 / 1e6,
        "cached_input": 800 * 0.10 / 1e6,
        "output": 100 * 3.0 / 1e6,
    }
    assert prices.cost(usage) == pytest.approx(sum(prices.cost_details(usage).values()), rel=1e-12)
    assert Prices.parse("") is None


@pytest.mark.parametrize(
    "text, complaint",
    [
        ("input:0.6,output:3", "missing cached_input"),
        ("input:0.6,cached_input:x,output:3", "no number"),
        ("input:0.6,cached:0.1,output:3", "unknown kind"),
        ("input:-1,cached_input:0.1,output:3", "negative"),
    ],
)
def test_bad_prices_are_refused_with_the_reason(text, complaint):
    with pytest.raises(ValueError, match=complaint):
        Prices.parse(text)
