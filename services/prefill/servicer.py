"""The Prefill service: run the prompt, sample the first token, push the KV, report.

The engine (prefill role) stops a request after its first token, holds its blocks, and hands
a copy of their KV out with that token. This handler pushes it from its own thread, so the
engine goes on prefilling other prompts while the bytes move. The blocks are released
whatever happens; their full blocks stay in this worker's prefix cache, which is where
`num_cached_tokens` comes from on the next request with the same prefix.
"""

from __future__ import annotations

import uuid

import grpc
import numpy as np
import torch

from services import faults
from services.kvtransfer import Senders, TransferError, TransferHeader, TransferRefused
from services.worker import convert
from services.worker.config import WorkerConfig
from services.worker.engine_loop import EngineLoop
from services.worker.servicer import add_request_or_abort, next_output
from tandem.v1 import worker_pb2, worker_pb2_grpc


def kv_payload(data: torch.Tensor) -> np.ndarray:
    """The exported blocks as flat bytes (no copy of a contiguous tensor)."""
    return data.contiguous().view(torch.uint8).numpy().reshape(-1)


class PrefillServicer(worker_pb2_grpc.PrefillServicer):
    def __init__(self, loop: EngineLoop, kv_timeout_s: float):
        self.loop = loop
        self.kv_timeout_s = kv_timeout_s
        self.senders = Senders()

    def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.ServicerContext):
        request_id = request.request_id or uuid.uuid4().hex
        if not request.kv_destination:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "kv_destination (a decode worker's kv_address) is required")
        out = next_output(context, add_request_or_abort(context, self.loop, request_id, request))
        response = worker_pb2.PrefillResponse(
            first_token_id=out.new_token_ids[0], logprobs=out.new_logprobs or [],
            num_prompt_tokens=out.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens,
        )
        if out.finish_reason != "prefilled":  # the first token ended it: nothing to decode
            response.finish_reason = convert.FINISH_REASONS[out.finish_reason]
            response.stop_string = out.stop_reason if isinstance(out.stop_reason, str) else ""
            return response
        faults.delay("prefill_delay_s")
        kv, timeout_s = out.kv, request.transfer_timeout_s or self.kv_timeout_s
        try:
            payload = kv_payload(kv.data)
            header = TransferHeader(
                request_id=request_id, nbytes=payload.nbytes, deadline_s=timeout_s, shape=list(kv.data.shape),
                dtype=str(kv.data.dtype).removeprefix("torch."), block_hashes=kv.block_hashes,
                first_token_id=kv.first_token_id,
            )
            self.senders.send(request.kv_destination, header, payload, timeout_s)
        except TransferRefused as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except TransferError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        finally:
            self.loop.abort(request_id, count=False)  # release the blocks (queued: never blocks)
        response.num_kv_bytes = payload.nbytes
        return response


def add_prefill_role(server: grpc.Server, loop: EngineLoop, config: WorkerConfig):
    servicer = PrefillServicer(loop, config.kv_timeout_s)
    worker_pb2_grpc.add_PrefillServicer_to_server(servicer, server)
    return "", servicer.senders.close
