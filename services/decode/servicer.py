"""The Decode service: claim the KV a prefill worker pushed, import it, stream the rest."""

from __future__ import annotations

import grpc

from services.decode.kv_inbox import KVInbox
from services.kvtransfer import create_receiver
from services.worker.config import WorkerConfig
from services.worker.engine_loop import EngineLoop
from services.worker.servicer import admit_or_abort, sampling_or_abort, stream_responses
from tandem.v1 import worker_pb2, worker_pb2_grpc


class DecodeServicer(worker_pb2_grpc.DecodeServicer):
    def __init__(self, loop: EngineLoop, inbox: KVInbox, kv_timeout_s: float):
        self.loop = loop
        self.inbox = inbox
        self.kv_timeout_s = kv_timeout_s

    def Decode(self, request: worker_pb2.DecodeRequest, context: grpc.ServicerContext):
        request_id = request.request_id
        if not request_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id (the Prefill call's) is required")
        params = sampling_or_abort(context, request.sampling)
        try:
            transfer = self.inbox.take(request_id, request.kv_wait_timeout_s or self.kv_timeout_s)
        except TimeoutError as exc:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        engine = self.loop.engine
        prompt = list(request.prompt_token_ids)

        def admit():
            try:
                return engine.import_kv(request_id, prompt, request.first_token_id, params, transfer.blocks,
                                        transfer.header.block_hashes)
            except Exception:
                engine.free_reserved(transfer.blocks)
                raise

        stream = admit_or_abort(context, self.loop, request_id, admit)
        responses = stream_responses(context, stream)
        first = next(responses)  # the first token: the Prefill response already carried it
        if first.finish_reason != worker_pb2.FINISH_REASON_UNSPECIFIED:
            del first.token_ids[:]
            yield first
        yield from responses


def add_decode_role(server: grpc.Server, loop: EngineLoop, config: WorkerConfig):
    inbox = KVInbox(loop, landed_ttl_s=config.kv_timeout_s)
    receiver = create_receiver(config.kv_transport, inbox.on_header, inbox.on_done)
    worker_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(loop, inbox, config.kv_timeout_s), server)
    address = receiver.start(config.host)

    def cleanup():
        receiver.close()
        inbox.close()

    return address, cleanup
