"""ManyCall's batches (services/worker/generate_many.py) around the call's end, without a worker:
the outputs sent while a batch is being written still go out when the caller has closed its
side and the last request has ended in the meantime."""

from __future__ import annotations

import asyncio

from services.worker.generate_many import ManyCall
from tandem.v1 import worker_pb2


class _Running:
    """A request still on the call (only the call's ending touches it)."""

    def cancel(self) -> None:
        raise AssertionError("a request that ended on its own was aborted")


async def _nothing_more():
    return
    yield  # an async generator: the caller closed its side at once


def _last(request_id: str) -> worker_pb2.GenerateItem:
    """A request's final output."""
    return worker_pb2.GenerateItem(
        request_id=request_id,
        response=worker_pb2.GenerateResponse(finish_reason=worker_pb2.FINISH_REASON_LENGTH),
    )


def test_final_outputs_sent_while_a_batch_is_written_are_not_dropped():
    async def scenario() -> list[list[str]]:
        call = ManyCall(state=None)
        call.members["r1"] = _Running()
        batches = call.run(_nothing_more())
        call.send(_last("r0"))
        first = await batches.__anext__()
        for _ in range(3):  # the reader sees the caller's side closed
            await asyncio.sleep(0)
        assert call.caller_done
        # While `first` is being written, r1's last output arrives and r1 leaves the call.
        call.send(_last("r1"))
        call.members.pop("r1")
        rest = [batch async for batch in batches]
        return [[i.request_id for i in b.items] for b in [first, *rest]]

    assert asyncio.run(scenario()) == [["r0"], ["r1"]]
