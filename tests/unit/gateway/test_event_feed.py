"""Following a numbered event stream: a snapshot (also in parts) starts it, batches must then
follow on without a gap and from the same incarnation, anything else asks for a resync."""

from __future__ import annotations

import pytest

from services.gateway.routing.event_feed import Numbering, ResyncNeeded


def test_a_snapshot_in_parts_then_batches_without_gaps():
    numbering = Numbering()
    # starts: drop what was held
    assert numbering.check("a", 10, snapshot=True, num_events=0, more=True)
    assert not numbering.check("a", 10, snapshot=True, num_events=0)  # its second part
    assert not numbering.check("a", 10, snapshot=False, num_events=3)
    assert not numbering.check("a", 13, snapshot=False, num_events=1)
    with pytest.raises(ResyncNeeded):
        numbering.check("a", 15, snapshot=False, num_events=1)  # 14 was due


@pytest.mark.parametrize("incarnation, first_seq", [("b", 10), ("a", 9)])
def test_a_new_incarnation_or_a_repeat_asks_for_a_resync(incarnation, first_seq):
    numbering = Numbering()
    numbering.check("a", 10, snapshot=True, num_events=0)
    with pytest.raises(ResyncNeeded):
        numbering.check(incarnation, first_seq, snapshot=False, num_events=1)


def test_nothing_before_a_snapshot():
    with pytest.raises(ResyncNeeded):
        Numbering().check("a", 0, snapshot=False, num_events=1)
