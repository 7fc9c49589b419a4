"""A worker's KV event log over a real engine loop: events numbered without gaps, a snapshot
that covers exactly the events before its number, and a subscriber that stops reading dropped."""

from __future__ import annotations

import asyncio

from engine.block_hash import hash_blocks
from engine.block_manager import KVEvent
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.requests import AddRequest
from engine.sampling_params import SamplingParams
from services import event_log
from services.worker import kv_events
from services.worker.engine_loop import EngineLoop


async def run_request(loop: EngineLoop, request_id: str, prompt: list[int]) -> None:
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    stream = await loop.submit(AddRequest(request_id, prompt, params))
    while not (await stream.next()).finished:
        pass


def test_events_are_numbered_and_the_snapshot_covers_what_came_before(hf_checkpoint):
    async def scenario():
        loop = EngineLoop(
            LLMEngine(EngineConfig(model=hf_checkpoint("llama")[1], kv_cache_bytes=1 << 20))
        )
        loop.kv_events.event_loop = asyncio.get_running_loop()
        loop.start()
        try:
            queue = loop.kv_events.subscribe()
            prompts = [list(range(3, 43)), list(range(50, 90))]  # 2 full blocks each
            for i, prompt in enumerate(prompts):
                await run_request(loop, f"r{i}", prompt)
            snapshot = await loop.acall(loop.kv_snapshot)
            batches, seq = [], 0
            while seq < snapshot.first_seq:
                batch = await asyncio.wait_for(queue.get(), 5)
                assert batch.first_seq == seq  # no gap, no repeat
                seq += len(batch.events)
                batches.append(batch)
            stored = [
                h for b in batches for e in b.events if e.kind == "stored" for h in e.block_hashes
            ]
            expected = hash_blocks(prompts[0], 16) + hash_blocks(prompts[1], 16)
            assert stored[:4] == expected
            assert set(expected) <= set(snapshot.events[0].block_hashes) and snapshot.snapshot
        finally:
            loop.stop()

    asyncio.run(scenario())


def test_a_subscriber_that_stops_reading_is_dropped(monkeypatch):
    monkeypatch.setattr(event_log, "MAX_QUEUED_BATCHES", 2)

    async def scenario():
        log = kv_events.KVEventLog()
        log.event_loop = asyncio.get_running_loop()
        queue = log.subscribe()
        for i in range(4):
            log.record([KVEvent("stored", (i,))])
        await asyncio.sleep(0.01)
        items = [queue.get_nowait() for _ in range(queue.qsize())]
        assert isinstance(items[-1], event_log.Unsubscribed) and not log._subscribers
        assert log.next_seq == 4

    asyncio.run(scenario())
