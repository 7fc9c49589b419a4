"""An in-process fake worker for the gateway's retry policy: a real grpc.aio server on a free
port that answers Health, Generate, GenerateMany, Prefill and Decode as a worker of its role does, with fixed
tokens and no engine, and can be told to misbehave:

- `fail`: refuse every call with this status before anything streams (UNAVAILABLE: down or
  draining; RESOURCE_EXHAUSTED: full; `details` is the error's text);
- `hang`: take calls and never answer (the caller's deadline ends them);
- `fail_after`: stream this many tokens, then die (UNAVAILABLE);
- `refuse_kv` (a decode worker): the KV a prefill worker sends it is refused with this status
  (RESOURCE_EXHAUSTED: no room; UNAVAILABLE: unreachable), which the prefill worker reports as
  a real one does, with the trailer `tandem-failed-peer: decode` (services/failed_peer.py).

Workers of one fleet share `fleet` (kv_address -> worker), so a fake prefill worker finds the
decode worker its KV is addressed to. Every call is logged in `calls` as (method, request_id).
"""

from __future__ import annotations

import asyncio

import grpc

from services import failed_peer
from tandem.v1 import worker_pb2, worker_pb2_grpc

# what every fake worker generates: the first from Prefill, the rest from Decode
TOKENS = (11, 12, 13, 14)


class FakeWorker(
    worker_pb2_grpc.WorkerServicer, worker_pb2_grpc.PrefillServicer, worker_pb2_grpc.DecodeServicer
):
    def __init__(
        self,
        role: str,
        fleet: dict | None = None,
        fail: grpc.StatusCode | None = None,
        details: str = "",
        hang: bool = False,
        fail_after: int = -1,
        refuse_kv: grpc.StatusCode | None = None,
    ):
        self.role, self.fleet = role, fleet if fleet is not None else {}
        self.fail, self.details, self.hang, self.fail_after, self.refuse_kv = (
            fail,
            details,
            hang,
            fail_after,
            refuse_kv,
        )
        self.calls: list[tuple[str, str]] = []
        self.server: grpc.aio.Server | None = None
        self.address = self.kv_address = ""

    async def start(self) -> FakeWorker:
        self.server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(self, self.server)
        worker_pb2_grpc.add_PrefillServicer_to_server(self, self.server)
        worker_pb2_grpc.add_DecodeServicer_to_server(self, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.address = f"127.0.0.1:{port}"
        if self.role == "decode":
            self.kv_address = f"tcp://127.0.0.1:{port}"
            self.fleet[self.kv_address] = self
        return self

    async def stop(self) -> None:
        await self.server.stop(grace=None)

    def called(self, method: str) -> list[str]:
        """The request ids of the calls to `method`, in order."""
        return [request_id for m, request_id in self.calls if m == method]

    async def _misbehave(self, context) -> None:
        """Fails or hangs the call as told, before it answers anything."""
        if self.fail is not None:
            await context.abort(
                self.fail, self.details or f"fake {self.role} worker: {self.fail.name}"
            )
        if self.hang:
            await asyncio.sleep(3600)

    async def Health(self, request, context):
        return worker_pb2.HealthResponse(
            role=self.role,
            block_size=16,
            num_blocks=1000,
            num_free_blocks=1000,
            max_num_seqs=8,
            kv_address=self.kv_address,
        )

    async def Generate(self, request, context):
        self.calls.append(("Generate", request.request_id))
        await self._misbehave(context)
        for response in self._stream(TOKENS, len(request.prompt_token_ids)):
            yield response
        if 0 <= self.fail_after < len(TOKENS):
            await context.abort(grpc.StatusCode.UNAVAILABLE, "fake worker died mid-stream")

    async def GenerateMany(self, requests, context):
        """Generate's answers a request, over one call (logged as Generate): `fail` refuses each
        request as a draining or full worker does, `hang` leaves it unanswered, and
        `fail_after` kills the whole call, as a worker that dies does."""
        async for message in requests:
            if not message.HasField("add"):
                continue
            request_id = message.add.request_id
            self.calls.append(("Generate", request_id))
            if self.fail is not None:
                error = self.details or f"fake {self.role} worker: {self.fail.name}"
                item = worker_pb2.GenerateItem(
                    request_id=request_id, error_code=self.fail.value[0], error_message=error
                )
                yield worker_pb2.GenerateBatch(items=[item])
                continue
            if self.hang:
                continue
            for response in self._stream(TOKENS, len(message.add.prompt_token_ids)):
                item = worker_pb2.GenerateItem(request_id=request_id, response=response)
                yield worker_pb2.GenerateBatch(items=[item])
            if 0 <= self.fail_after < len(TOKENS):
                await context.abort(grpc.StatusCode.UNAVAILABLE, "fake worker died mid-stream")

    async def Prefill(self, request, context):
        self.calls.append(("Prefill", request.request_id))
        await self._misbehave(context)
        decode = self.fleet[request.kv_destination]
        if decode.refuse_kv is not None:
            decode.calls.append(("KV refused", request.request_id))
            await context.abort(
                decode.refuse_kv,
                f"KV transfer to {request.kv_destination} refused",
                failed_peer.DECODE_FAILED,
            )
        decode.calls.append(("KV", request.request_id))
        return worker_pb2.PrefillResponse(
            first_token_id=TOKENS[0],
            num_prompt_tokens=len(request.prompt_token_ids),
            num_cached_tokens=0,
        )

    async def Decode(self, request, context):
        self.calls.append(("Decode", request.request_id))
        await self._misbehave(context)
        if ("KV", request.request_id) not in self.calls:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no KV landed for this request")
        for response in self._stream(TOKENS[1:], len(request.prompt_token_ids)):
            yield response
        if 0 <= self.fail_after < len(TOKENS) - 1:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "fake worker died mid-stream")

    def _stream(self, tokens, num_prompt_tokens: int):
        """One response a token, the last one finished; cut at `fail_after` tokens."""
        limit = len(tokens) if self.fail_after < 0 else min(self.fail_after, len(tokens))
        for i, token in enumerate(tokens[:limit]):
            last = i == len(tokens) - 1
            yield worker_pb2.GenerateResponse(
                token_ids=[token],
                num_prompt_tokens=num_prompt_tokens,
                finish_reason=worker_pb2.FINISH_REASON_LENGTH
                if last
                else worker_pb2.FINISH_REASON_UNSPECIFIED,
            )
