"""The Draft service over a draft model (engine/speculative/draft_model.py) or an EAGLE-3 head
(engine/speculative/eagle3.py), which also takes the target's hidden states the worker sends.

Each worker's requests are followed under their own names (worker, request id). A request's
tokens are rebuilt from what the worker sends each call: the tokens after the `synced` ones
it sent before. One that the service does not know at `synced` (it restarted, or forgot it)
gets no draft and `resync`, and the worker sends all its tokens next time. A request its
worker has not mentioned for IDLE_S (the worker died before reporting its end) is dropped.
The draft model runs on a thread of its own (one batch at a time), so the event loop keeps
answering.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import torch

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.speculative.base import Draft, Drafter
from tandem.v1 import draft_pb2, draft_pb2_grpc

FOLLOWED = SamplingParams(max_tokens=1 << 30, temperature=0)
IDLE_S = 300.0


class DraftServicer(draft_pb2_grpc.DraftServicer):
    def __init__(self, drafter: Drafter):
        self.drafter = drafter
        self.aux_layers = tuple(drafter.aux_layers)
        self._tokens: dict[str, list[int]] = {}  # "worker/request id" -> its tokens so far
        self._seen: dict[str, float] = {}  # ... -> when its worker last mentioned it
        self._lock = threading.Lock()  # one batch through the draft model at a time

    async def Propose(
        self, request: draft_pb2.ProposeRequest, context
    ) -> draft_pb2.ProposeResponse:
        return await asyncio.to_thread(self._propose, request)

    def _propose(self, request: draft_pb2.ProposeRequest) -> draft_pb2.ProposeResponse:
        with self._lock:
            now = time.monotonic()
            ended = [f"{request.worker}/{request_id}" for request_id in request.ended_request_ids]
            for key in ended + [key for key, seen in self._seen.items() if now - seen > IDLE_S]:
                self._tokens.pop(key, None)
                self._seen.pop(key, None)
                self.drafter.forget(key)
            seqs, ks, answers = [], [], []
            for sequence in request.sequences:
                key = f"{request.worker}/{sequence.request_id}"
                self._seen[key] = now
                tokens = self._tokens.get(key, [])
                if len(tokens) < sequence.synced:
                    answers.append(draft_pb2.DraftTokens(resync=True))
                    continue
                tokens = self._tokens[key] = tokens[: sequence.synced] + list(
                    sequence.new_token_ids
                )
                seq = Sequence(key, [], _params(sequence), seed=sequence.seed)
                seq.token_ids = tokens
                row_bytes = 2 * getattr(self.drafter, "feature_size", 0)
                if (
                    sequence.features and row_bytes and len(sequence.features) % row_bytes == 0
                ):  # else: no draft
                    rows = torch.from_numpy(np.frombuffer(sequence.features, dtype=np.int16).copy())
                    self.drafter.add_features(
                        seq,
                        sequence.features_start,
                        rows.view(torch.bfloat16).view(-1, self.drafter.feature_size),
                    )
                seqs.append(seq)
                ks.append(sequence.max_tokens)
                answers.append(None)
            drafts = iter(self.drafter.propose(seqs, ks) if seqs else [])
            return draft_pb2.ProposeResponse(
                aux_layers=self.aux_layers,
                drafts=[answer or _tokens(next(drafts)) for answer in answers],
            )


def _params(sequence: draft_pb2.DraftSequence) -> SamplingParams:
    """How to draft for this sequence: argmax, or draws from q under its sampling settings."""
    if sequence.temperature > 0:
        try:
            return SamplingParams(
                max_tokens=1 << 30,
                temperature=sequence.temperature,
                top_k=sequence.top_k,
                top_p=sequence.top_p or 1.0,
                min_p=sequence.min_p,
            )
        except InvalidRequestError:
            pass  # settings no request could have: draft the argmax
    return FOLLOWED


def _tokens(draft: Draft) -> draft_pb2.DraftTokens:
    if draft.q is None:
        return draft_pb2.DraftTokens(token_ids=draft.token_ids)
    return draft_pb2.DraftTokens(
        token_ids=draft.token_ids,
        q_token_ids=draft.q_ids.flatten().tolist(),
        q=draft.q.flatten().tolist(),
    )
