"""The Worker gRPC service over an EngineLoop (grpc.aio): Generate and GenerateMany (colocated
role), KVEvents and Health (all roles). What the roles' servicers share is in calls.py.
"""

from __future__ import annotations

import uuid

import grpc

from engine.requests import AddRequest
from services.event_log import EventBatch, Unsubscribed, batches_after
from services.worker.calls import Request, WorkerState, sampling_params
from services.worker.generate_many import ManyCall
from tandem.v1 import worker_pb2, worker_pb2_grpc


def event_batch(incarnation: str, batch: EventBatch) -> worker_pb2.KVEventBatch:
    return worker_pb2.KVEventBatch(
        incarnation=incarnation,
        first_seq=batch.first_seq,
        snapshot=batch.snapshot,
        events=[
            worker_pb2.KVEvent(evicted=e.kind == "evicted", block_hashes=e.block_hashes)
            for e in batch.events
        ],
    )


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, state: WorkerState):
        self.state = state

    async def Generate(
        self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ):
        if self.state.role != "both":
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this is a {self.state.role} worker; Generate runs on colocated workers",
            )
        await self.state.check_accepting(context)
        params = await sampling_params(context, request.sampling)
        request_id = request.request_id or uuid.uuid4().hex
        prompt, cache_salt = list(request.prompt_token_ids), request.cache_salt
        async with (
            self.state.serving(context, "generate") as span,
            Request(
                self.state.loop,
                request_id,
                on_prompt_done=lambda: self.state.offer_to_store(prompt, cache_salt),
            ) as req,
        ):
            span.set_attribute("tandem.num_prompt_tokens", len(prompt))
            await self.state.admit(
                req, AddRequest(request_id, prompt, params, cache_salt=cache_salt)
            )
            async for response in req.responses():
                yield response

    async def GenerateMany(self, requests, context: grpc.aio.ServicerContext):
        if self.state.role != "both":
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this is a {self.state.role} worker; GenerateMany runs on colocated workers",
            )
        async for batch in ManyCall(self.state).run(requests):
            yield batch

    async def KVEvents(
        self, request: worker_pb2.KVEventsRequest, context: grpc.aio.ServicerContext
    ):
        loop = self.state.loop
        queue = loop.kv_events.subscribe()  # before the snapshot: no batch after it is missed
        try:
            snapshot = await loop.acall(loop.kv_snapshot)
            yield event_batch(loop.kv_events.incarnation, snapshot)
            async for batch in batches_after(queue, snapshot):
                yield event_batch(loop.kv_events.incarnation, batch)
        except Unsubscribed:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, "KV events subscriber fell behind; resubscribe"
            )
        finally:
            loop.kv_events.unsubscribe(queue)

    async def Health(self, request: worker_pb2.HealthRequest, context: grpc.aio.ServicerContext):
        stats = self.state.loop.stats
        return worker_pb2.HealthResponse(
            model=self.state.model_name,
            role=self.state.role,
            num_blocks=stats.num_blocks,
            num_free_blocks=stats.num_free_blocks,
            block_size=self.state.loop.engine.kv.layout.block_size,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            max_model_len=stats.max_model_len,
            num_aborted=stats.num_aborted,
            kv_address=self.state.kv_address,
            num_requests=stats.num_requests,
            # A broken engine reports itself as leaving, so the gateway routes around it.
            draining=self.state.draining or bool(self.state.loop.broken),
            max_num_seqs=self.state.max_num_seqs,
            kv_store_namespace=self.state.kv_store.namespace
            if self.state.kv_store is not None
            else "",
            speculative=self.state.speculative,
            num_draft_tokens=stats.num_draft_tokens,
            num_accepted_draft_tokens=stats.num_accepted_draft_tokens,
            draft_acceptance_rate=(
                stats.num_accepted_draft_tokens / stats.num_draft_tokens
                if stats.num_draft_tokens
                else 0.0
            ),
        )
