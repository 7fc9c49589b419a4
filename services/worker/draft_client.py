"""Drafting from the draft service (services/draft), `--draft HOST:PORT`: an engine drafter.

The engine asks on its own thread, once per step, for the whole batch: one blocking call
under a deadline (`timeout_s`). Each request's tokens go once: after the first call only
those the service has not had (`synced`). Requests that ended ride along in the next call.
A failure (the service died, stalled, or answered late) means no drafts this step, so the
step decodes plainly and no request fails or waits longer than the deadline; after
MAX_FAILURES in a row the service is skipped for BACKOFF_S.

A service with an EAGLE-3 head names its `aux_layers` in each answer (the first call is made
at start, with no sequences, to learn them). From then on the engine
hands this drafter the target's hidden states there for each verified position
(`add_features`), and each request's rows not yet sent ride with its next call (bf16).
"""

from __future__ import annotations

import logging
import time
import uuid

import grpc
import torch

from engine.sequence import Sequence
from engine.speculative.base import Draft, Drafter
from engine.speculative.draw import draws_with_q
from tandem.v1 import draft_pb2, draft_pb2_grpc

log = logging.getLogger(__name__)
MAX_FAILURES = 3
BACKOFF_S = 10.0
MAX_ENDED = 4096  # ended requests kept to report while the service is away


class RemoteDrafter(Drafter):
    def __init__(self, address: str, timeout_s: float = 0.5):
        self.address, self.timeout_s = address, timeout_s
        self.channel = grpc.insecure_channel(address)
        self.stub = draft_pb2_grpc.DraftStub(self.channel)
        self.worker = uuid.uuid4().hex
        self._synced: dict[str, int] = {}
        self._ended: list[str] = []
        self.num_failures = 0
        self.skip_until = 0.0
        self.aux_layers: tuple[int, ...] = ()  # what the service's head reads; () for a draft model
        # request id -> (start, rows) unsent
        self._features: dict[str, tuple[int, list[torch.Tensor]]] = {}
        # learns aux_layers now, so the first prompts' features are kept (if it answers)
        self.propose([], [])

    def add_features(self, seq: Sequence, start: int, aux: torch.Tensor) -> None:
        pending = self._features.get(seq.request_id)
        if pending is not None and pending[0] + sum(len(rows) for rows in pending[1]) == start:
            pending[1].append(aux.to(torch.bfloat16))
        else:  # the first rows, or a restart (preemption): the service restarts from `start` too
            self._features[seq.request_id] = (start, [aux.to(torch.bfloat16)])

    def _sequence(self, seq: Sequence, k: int) -> draft_pb2.DraftSequence:
        synced = self._synced.get(seq.request_id, 0)
        message = draft_pb2.DraftSequence(
            request_id=seq.request_id,
            synced=synced,
            new_token_ids=seq.token_ids[synced:],
            max_tokens=k,
        )
        if draws_with_q(seq):
            p = seq.params
            message.temperature, message.top_k, message.top_p, message.min_p = (
                p.temperature,
                p.top_k,
                p.top_p,
                p.min_p,
            )
            message.seed = seq.seed
        pending = self._features.get(seq.request_id)
        if pending is not None:
            message.features_start = pending[0]
            message.features = torch.cat(pending[1]).view(torch.int16).numpy().tobytes()
        return message

    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[Draft]:
        if time.monotonic() < self.skip_until:
            return [Draft() for _ in seqs]
        request = draft_pb2.ProposeRequest(
            worker=self.worker,
            ended_request_ids=self._ended,
            sequences=[self._sequence(seq, k) for seq, k in zip(seqs, max_tokens)],
        )
        try:
            reply = self.stub.Propose(request, timeout=self.timeout_s)
        except grpc.RpcError as exc:  # the same tokens go again next time: resending is harmless
            self.num_failures += 1
            if self.num_failures >= MAX_FAILURES:
                log.warning(
                    "draft service %s failed %d times in a row (%s); decoding without it for %.0fs",
                    self.address,
                    self.num_failures,
                    exc.code().name,
                    BACKOFF_S,
                )
                self.num_failures, self.skip_until = 0, time.monotonic() + BACKOFF_S
            return [Draft() for _ in seqs]
        self.num_failures = 0
        self._ended = []
        self.aux_layers = tuple(reply.aux_layers)
        drafts = []
        for seq, draft in zip(seqs, reply.drafts):
            self._features.pop(seq.request_id, None)  # sent
            self._synced[seq.request_id] = 0 if draft.resync else len(seq.token_ids)
            drafts.append(_draft(draft))
        return drafts

    def forget(self, request_id: str) -> None:
        self._features.pop(request_id, None)
        if self._synced.pop(request_id, None) is not None:
            self._ended = (self._ended + [request_id])[-MAX_ENDED:]

    def close(self) -> None:
        self.channel.close()


def _draft(reply: draft_pb2.DraftTokens) -> Draft:
    n = len(reply.token_ids)
    if not n or not reply.q or len(reply.q) % n or len(reply.q_token_ids) != len(reply.q):
        return Draft(list(reply.token_ids))  # one-hot (a q of the wrong shape is not trusted)
    return Draft(
        list(reply.token_ids),
        torch.tensor(reply.q_token_ids, dtype=torch.long).view(n, -1),
        torch.tensor(reply.q, dtype=torch.float32).view(n, -1),
    )
