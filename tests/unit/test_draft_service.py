"""The draft service's bookkeeping, its draft model replaced by a recorder: each request's
tokens rebuilt from what its worker sends (only the new ones after the first call), a
request it cannot follow answered with `resync`, and ended or long-idle requests dropped."""

from __future__ import annotations

from engine.speculative.base import Draft, Drafter
from services.draft import servicer as draft_servicer
from tandem.v1 import draft_pb2


class Recorder(Drafter):
    def __init__(self):
        self.seen, self.forgotten = [], []

    def propose(self, seqs, max_tokens):
        self.seen.append([(s.request_id, list(s.token_ids)) for s in seqs])
        return [Draft([7] * k) for k in max_tokens]

    def forget(self, request_id):
        self.forgotten.append(request_id)


def propose(servicer, *sequences, ended=()) -> list:
    request = draft_pb2.ProposeRequest(
        worker="w",
        ended_request_ids=list(ended),
        sequences=[
            draft_pb2.DraftSequence(request_id=r, synced=synced, new_token_ids=new, max_tokens=2)
            for r, synced, new in sequences
        ],
    )
    return list(servicer._propose(request).drafts)


def test_tokens_are_rebuilt_from_what_is_new_and_a_stranger_is_asked_to_resync(monkeypatch):
    recorder = Recorder()
    servicer = draft_servicer.DraftServicer(recorder)
    assert [d.token_ids for d in propose(servicer, ("a", 0, [1, 2, 3]))] == [[7, 7]]
    propose(servicer, ("a", 3, [4, 5]))
    assert recorder.seen[-1] == [("w/a", [1, 2, 3, 4, 5])]
    restarted = draft_servicer.DraftServicer(Recorder())
    [answer] = propose(restarted, ("a", 5, [6]))
    assert answer.resync and not answer.token_ids
    propose(servicer, ended=["a"])
    assert recorder.forgotten == ["w/a"]
    propose(servicer, ("b", 0, [1]))
    monkeypatch.setattr(draft_servicer, "IDLE_S", -1.0)  # every request is now long idle
    propose(servicer)
    assert "w/b" in recorder.forgotten and not servicer._tokens
