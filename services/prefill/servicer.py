"""The Prefill service: run the prompt, sample the first token, push the KV, report.

The engine (prefill role) stops a request after its first token, holds its blocks, and hands
a copy of their KV out with that token. This handler pushes it from a thread of the default
executor (the transports block), so the event loop and the engine go on with other prompts
while the bytes move. The blocks are released whatever happens; their full blocks stay in
this worker's prefix cache, which is where `num_cached_tokens` comes from on the next
request with the same prefix.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc
import numpy as np
import torch
from opentelemetry import trace

from engine.requests import AddRequest
from services import failed_peer, faults, tracing
from services.kvtransfer import Senders, TransferError, TransferHeader, TransferRefused
from services.worker import convert, metrics
from services.worker.calls import Request, WorkerState, sampling_params
from services.worker.config import WorkerConfig
from tandem.v1 import worker_pb2, worker_pb2_grpc


def kv_payload(data: torch.Tensor) -> np.ndarray:
    """The exported blocks as flat bytes (no copy of a contiguous tensor)."""
    return data.contiguous().view(torch.uint8).numpy().reshape(-1)


class PrefillServicer(worker_pb2_grpc.PrefillServicer):
    def __init__(self, state: WorkerState, kv_timeout_s: float):
        self.state = state
        self.kv_timeout_s = kv_timeout_s
        self.senders = Senders()

    async def Prefill(self, request: worker_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        await self.state.check_accepting(context)
        request_id = request.request_id or uuid.uuid4().hex
        if not request.kv_destination:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "kv_destination (a decode worker's kv_address) is required",
            )
        params = await sampling_params(context, request.sampling)
        prompt, cache_salt = list(request.prompt_token_ids), request.cache_salt
        async with (
            self.state.serving(context, "prefill") as span,
            Request(
                self.state.loop,
                request_id,
                count_abort=False,
                on_prompt_done=lambda: self.state.offer_to_store(prompt, cache_salt),
            ) as req,
        ):
            await self.state.admit(
                req, AddRequest(request_id, prompt, params, cache_salt=cache_salt)
            )
            out = await req.next()
            span.set_attribute("tandem.num_prompt_tokens", out.num_prompt_tokens)
            span.set_attribute("tandem.num_cached_tokens", out.num_cached_tokens)
            response = worker_pb2.PrefillResponse(
                first_token_id=out.new_token_ids[0],
                logprobs=out.new_logprobs or [],
                num_prompt_tokens=out.num_prompt_tokens,
                num_cached_tokens=out.num_cached_tokens,
                store_tokens=req.store_tokens(out),
            )
            if out.new_top_logprobs:
                response.top_logprobs.CopyFrom(convert.top_logprobs(out.new_top_logprobs[0]))
            if out.finish_reason != "prefilled":  # the first token ended it: nothing to decode
                response.finish_reason = convert.FINISH_REASONS[out.finish_reason]
                response.stop_string = out.stop_reason if isinstance(out.stop_reason, str) else ""
                return response
            req.finished = False  # "prefilled": the blocks are held until the KV has moved
            response.num_kv_bytes = await self._push(context, request, request_id, out.kv, span)
            return response

    async def _push(
        self, context, request: worker_pb2.PrefillRequest, request_id: str, kv, parent
    ) -> int:
        await asyncio.to_thread(faults.delay, "prefill_delay_s")
        timeout_s = request.transfer_timeout_s or self.kv_timeout_s
        header = TransferHeader(
            request_id=request_id,
            nbytes=kv.data.nbytes,
            deadline_s=timeout_s,
            shape=list(kv.data.shape),
            dtype=str(kv.data.dtype).removeprefix("torch."),
            block_hashes=kv.block_hashes,
            first_token_id=kv.first_token_id,
        )
        span, _ = tracing.start_span(
            "kv_transfer", trace.set_span_in_context(parent), kv_destination=request.kv_destination
        )
        started = time.perf_counter()
        try:
            # Only the blocks the decode worker lacks: it names how many leading ones it holds.
            nbytes = await asyncio.to_thread(
                self.senders.send,
                request.kv_destination,
                header,
                lambda skip_blocks: kv_payload(kv.data[:, skip_blocks:]),
                timeout_s,
            )
            span.set_attribute("tandem.kv_bytes", nbytes)
        except TransferRefused as exc:  # the decode worker refused it (no room, draining)
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), failed_peer.DECODE_FAILED
            )
        except TransferError as exc:  # the KV did not reach the decode worker
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc), failed_peer.DECODE_FAILED)
        finally:
            span.end()
        metrics.KV_TRANSFER_BYTES.labels("sent").inc(nbytes)
        metrics.KV_TRANSFER_SECONDS.labels("sent").observe(time.perf_counter() - started)
        return nbytes


def add_prefill_role(server: grpc.aio.Server, state: WorkerState, config: WorkerConfig):
    servicer = PrefillServicer(state, config.kv_timeout_s)
    worker_pb2_grpc.add_PrefillServicer_to_server(servicer, server)
    return servicer.senders.close
