"""The Decode service: claim the KV a prefill worker pushed, import it, stream the rest."""

from __future__ import annotations

import grpc

from engine.requests import AddRequest, FromPrefill
from services.decode.kv_inbox import KVInbox
from services.kvtransfer import create_receiver
from services.worker import metrics
from services.worker.calls import Request, WorkerState, sampling_params
from services.worker.config import WorkerConfig
from tandem.v1 import worker_pb2, worker_pb2_grpc


class DecodeServicer(worker_pb2_grpc.DecodeServicer):
    def __init__(self, state: WorkerState, inbox: KVInbox, kv_timeout_s: float):
        self.state = state
        self.inbox = inbox
        self.kv_timeout_s = kv_timeout_s

    async def Decode(self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext):
        # Not refused while draining: its KV was accepted before the drain, or it times out.
        request_id = request.request_id
        if not request_id:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "request_id (the Prefill call's) is required"
            )
        params = await sampling_params(context, request.sampling)
        prompt = list(request.prompt_token_ids)
        async with (
            self.state.serving(context, "decode") as span,
            Request(self.state.loop, request_id, count_prompt=False) as req,
        ):
            try:
                transfer = await self.inbox.take(
                    request_id, request.kv_wait_timeout_s or self.kv_timeout_s
                )
            except TimeoutError as exc:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
            metrics.KV_TRANSFER_BYTES.labels("received").inc(transfer.num_bytes_received)
            span.set_attribute("tandem.kv_bytes", transfer.num_bytes_received)
            span.set_attribute("tandem.kv_blocks_reused", transfer.num_cached)
            # The engine owns the reserved blocks from here: it frees them if the import fails.
            kv = FromPrefill(
                transfer.reservation, request.first_token_id, transfer.header.block_hashes
            )
            await req.admit(AddRequest(request_id, prompt, params, kv, request.cache_salt))
            responses = req.responses()
            # the first token: the Prefill response already carried it
            first = await anext(responses)
            if first.finish_reason != worker_pb2.FINISH_REASON_UNSPECIFIED:
                for repeated in (first.token_ids, first.logprobs, first.top_logprobs):
                    del repeated[:]
                yield first
            async for response in responses:
                yield response


def add_decode_role(server: grpc.aio.Server, state: WorkerState, config: WorkerConfig):
    inbox = KVInbox(state.loop, landed_ttl_s=config.kv_timeout_s)
    receiver = create_receiver(config.kv_transport, inbox.on_header, inbox.on_done)
    worker_pb2_grpc.add_DecodeServicer_to_server(
        DecodeServicer(state, inbox, config.kv_timeout_s), server
    )
    state.kv_address = receiver.start(config.host)
    state.kv_inbox = inbox

    def cleanup():
        receiver.close()
        inbox.close()

    return cleanup
