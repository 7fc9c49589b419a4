"""WorkerPool's retry policy (services/gateway/worker_pool.py) against fake workers on real gRPC
(fake_worker.py): which failures are retried, on which side, which worker is marked down, how
long a hang costs, and that nothing reaches the client twice."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from services.gateway.errors import GatewayError
from services.gateway.protocol import GenerationRequest, SamplingOptions
from services.gateway.routing.affinity import AffinityTable
from services.gateway.routing.endpoints import Endpoint, EndpointSet
from services.gateway.routing.policies import Policy, Route
from services.gateway.worker_pool import WorkerPool
from tests.unit.gateway.fake_worker import TOKENS, FakeWorker

PREFILL_TIMEOUT_S = 0.3
REQUEST_TIMEOUT_S = 0.6
UNAVAILABLE, EXHAUSTED = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED


class InOrder(Policy):
    """Picks the first candidate in the order the test listed the workers: which worker is
    tried first, and which next, is the test's to say."""

    name = "in_order"

    def __init__(self, order: list[str]):
        super().__init__(index=None)
        self.order = order

    def pick(self, role: str, request, candidates: list[Endpoint]) -> Route | None:
        return Route(min(candidates, key=lambda e: self.order.index(e.address)), "in_order")


class Fleet:
    """Fake workers, started, and a WorkerPool over them that prefers them in the order given."""

    def __init__(self, **roles: list[FakeWorker]):
        self.roles = roles

    async def __aenter__(self) -> Fleet:
        fleet: dict = {}
        for workers in self.roles.values():
            for worker in workers:
                worker.fleet = fleet
                await worker.start()
        order = [w.address for workers in self.roles.values() for w in workers]
        self.endpoints = EndpointSet(
            {role: [w.address for w in workers] for role, workers in self.roles.items()}
        )
        # one health poll: every fake worker answers, so all are eligible
        await self.endpoints.refresh()
        self.pool = WorkerPool(
            self.endpoints, REQUEST_TIMEOUT_S, PREFILL_TIMEOUT_S, InOrder(order), AffinityTable()
        )
        return self

    async def __aexit__(self, *exc) -> None:
        await self.pool.close()
        for workers in self.roles.values():
            for worker in workers:
                await worker.stop()

    def healthy(self, worker: FakeWorker) -> bool:
        return next(e for e in self.endpoints.endpoints() if e.address == worker.address).healthy

    async def generate(self) -> tuple[list[int], GatewayError | None]:
        """The tokens the client would see, and the error that ended the stream (None: finished)."""
        request = GenerationRequest("req", [1, 2, 3], SamplingOptions(max_tokens=len(TOKENS)))
        tokens = []
        try:
            async for chunk in self.pool.generate(request):
                tokens += chunk.token_ids
        except GatewayError as exc:
            return tokens, exc
        return tokens, None


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize(
    "details", ["fake prefill worker: UNAVAILABLE", "KV transfer to tcp://x failed"]
)
def test_a_prefill_worker_that_is_down_is_marked_down_and_another_is_tried(details):
    # The text is no evidence either way: only the trailer says a failure was the decode side's.
    down, up, decode = (
        FakeWorker("prefill", fail=UNAVAILABLE, details=details),
        FakeWorker("prefill"),
        FakeWorker("decode"),
    )

    async def scenario():
        async with Fleet(prefill=[down, up], decode=[decode]) as fleet:
            assert await fleet.generate() == (list(TOKENS), None)
            assert not fleet.healthy(down) and fleet.healthy(up) and fleet.healthy(decode)
            assert down.called("Prefill") == ["req-0"] and up.called("Prefill") == ["req-1"]
            assert decode.called("Decode") == ["req-1"]  # the retry's KV, never the dead attempt's

    run(scenario())


@pytest.mark.parametrize("refusal", [EXHAUSTED, UNAVAILABLE])
def test_a_kv_refusal_by_the_decode_side_goes_to_another_decode_worker_and_keeps_the_prefill_worker(
    refusal,
):
    prefill, full, decode = (
        FakeWorker("prefill"),
        FakeWorker("decode", refuse_kv=refusal),
        FakeWorker("decode"),
    )

    async def scenario():
        async with Fleet(prefill=[prefill], decode=[full, decode]) as fleet:
            assert await fleet.generate() == (list(TOKENS), None)
            assert fleet.healthy(prefill) and fleet.healthy(full)
            # the same prefill worker, tried again
            assert prefill.called("Prefill") == ["req-0", "req-1"]
            assert full.called("KV refused") == ["req-0"] and not full.called("Decode")
            assert decode.called("KV") == decode.called("Decode") == ["req-1"]

    run(scenario())


def test_a_decode_side_failure_retries_on_the_same_prefill_worker_even_where_there_are_others():
    first, second = FakeWorker("prefill"), FakeWorker("prefill")
    full, decode = FakeWorker("decode", refuse_kv=EXHAUSTED), FakeWorker("decode")

    async def scenario():
        async with Fleet(prefill=[first, second], decode=[full, decode]) as fleet:
            assert await fleet.generate() == (list(TOKENS), None)
            assert first.called("Prefill") == ["req-0", "req-1"] and not second.calls

    run(scenario())


def test_a_hung_prefill_worker_costs_at_most_the_prefill_deadline():
    hung, up, decode = FakeWorker("prefill", hang=True), FakeWorker("prefill"), FakeWorker("decode")

    async def scenario():
        async with Fleet(prefill=[hung, up], decode=[decode]) as fleet:
            started = time.monotonic()
            assert await fleet.generate() == (list(TOKENS), None)
            assert PREFILL_TIMEOUT_S <= time.monotonic() - started < PREFILL_TIMEOUT_S + 0.5
            assert hung.called("Prefill") == ["req-0"] and up.called("Prefill") == ["req-1"]
            assert fleet.healthy(hung)  # slow is not gone: the health poll decides

    run(scenario())


def test_a_hung_colocated_worker_ends_the_request_at_its_deadline():
    hung = FakeWorker("both", hang=True)

    async def scenario():
        async with Fleet(both=[hung]) as fleet:
            started = time.monotonic()
            tokens, error = await fleet.generate()
            assert not tokens and error.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert REQUEST_TIMEOUT_S <= time.monotonic() - started < REQUEST_TIMEOUT_S + 0.5

    run(scenario())


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_resource_exhausted_everywhere_is_resource_exhausted(side):
    full = {"fail": EXHAUSTED} if side == "prefill" else {}
    refuse = {"refuse_kv": EXHAUSTED} if side == "decode" else {}
    prefills = [FakeWorker("prefill", **full), FakeWorker("prefill", **full)]
    decodes = [FakeWorker("decode", **refuse), FakeWorker("decode", **refuse)]

    async def scenario():
        async with Fleet(prefill=prefills, decode=decodes) as fleet:
            tokens, error = await fleet.generate()
            # a 429: the client should come back later
            assert not tokens and error.code == EXHAUSTED
            assert all(fleet.healthy(w) for w in prefills + decodes)  # full, not gone
            tried = decodes if side == "decode" else prefills
            assert [
                len(w.called("KV refused" if side == "decode" else "Prefill")) for w in tried
            ] == [1, 1]

    run(scenario())


def test_a_colocated_refusal_is_retried_on_another_worker_and_streamed_once():
    down, up = FakeWorker("both", fail=UNAVAILABLE), FakeWorker("both")

    async def scenario():
        async with Fleet(both=[down, up]) as fleet:
            assert await fleet.generate() == (list(TOKENS), None)
            assert not fleet.healthy(down) and len(up.called("Generate")) == 1

    run(scenario())


@pytest.mark.parametrize("role", ["both", "decode"])
def test_a_worker_that_dies_mid_stream_is_not_retried_and_nothing_is_sent_twice(role):
    dying, spare = FakeWorker(role, fail_after=1), FakeWorker(role)
    roles = (
        {"both": [dying, spare]}
        if role == "both"
        else {"prefill": [FakeWorker("prefill")], "decode": [dying, spare]}
    )

    async def scenario():
        async with Fleet(**roles) as fleet:
            tokens, error = await fleet.generate()
            # the prefill's first token, then one
            sent = list(TOKENS[:1]) if role == "both" else list(TOKENS[:2])
            assert (
                tokens == sent and error.code == UNAVAILABLE and f"{role} worker" in error.message
            )
            # no second stream after a first token
            assert not spare.called("Generate") and not spare.called("Decode")
            assert not fleet.healthy(dying)

    run(scenario())


@pytest.mark.parametrize("failure, code", [("refused", EXHAUSTED), ("failed", UNAVAILABLE)])
def test_the_prefill_worker_names_the_decode_side_when_its_kv_transfer_fails(failure, code):
    """The trailer the policy reads is the one the real Prefill servicer writes."""
    from types import SimpleNamespace

    import torch
    from opentelemetry import trace

    from services import failed_peer
    from services.kvtransfer import TransferError, TransferRefused
    from services.prefill.servicer import PrefillServicer
    from tandem.v1 import worker_pb2

    class Senders:
        def send(self, address, header, payload, timeout_s):
            raise (TransferRefused if failure == "refused" else TransferError)(
                f"KV transfer to {address} {failure}"
            )

    class Context:
        async def abort(self, code, details="", trailing_metadata=()):
            self.aborted = code, trailing_metadata
            raise grpc.aio.AbortError()

    servicer, context = PrefillServicer.__new__(PrefillServicer), Context()
    servicer.senders, servicer.kv_timeout_s = Senders(), 1.0
    kv = SimpleNamespace(data=torch.zeros(2, 1, 4), block_hashes=[7], first_token_id=5)
    with pytest.raises(grpc.aio.AbortError):
        run(
            servicer._push(
                context,
                worker_pb2.PrefillRequest(kv_destination="tcp://decode:1"),
                "req-0",
                kv,
                trace.INVALID_SPAN,
            )
        )
    assert context.aborted == (code, failed_peer.DECODE_FAILED)
    assert failed_peer.of(context.aborted[1]) == failed_peer.DECODE
