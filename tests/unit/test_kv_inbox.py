"""A decode worker's KV inbox over a real engine loop: blocks are reserved on accept, written
on landing, handed to the Decode call, and freed on failure or when nobody claims them."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import torch

from engine.block_hash import hash_blocks
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.requests import Reservation
from engine.sampling_params import SamplingParams
from services.decode.kv_inbox import KVInbox
from services.kvtransfer import TransferHeader, TransferRefused
from services.worker.engine_loop import EngineLoop


@pytest.fixture
def loop(hf_checkpoint):
    engine = LLMEngine(
        EngineConfig(model=hf_checkpoint("llama")[1], role="decode", kv_cache_bytes=1 << 20)
    )
    loop = EngineLoop(engine)
    loop.start()
    yield loop
    loop.stop()


def header_for(inbox: KVInbox, request_id: str, num_blocks: int) -> TransferHeader:
    shape = [inbox.block_shape[0], num_blocks, *inbox.block_shape[1:]]
    nbytes = int(np.prod(shape)) * inbox.dtype.itemsize
    return TransferHeader(request_id, nbytes, deadline_s=5, shape=shape, dtype=str(inbox.dtype)[6:])


def wait_for_free(loop: EngineLoop, expected: int) -> None:
    deadline = time.monotonic() + 10  # a hang guard only
    while loop.call(lambda: loop.engine.num_free_blocks) != expected:
        assert time.monotonic() < deadline, "blocks were never freed"
        time.sleep(0.01)


def test_landed_blocks_hold_the_bytes_and_are_handed_over(loop):
    inbox = KVInbox(loop, landed_ttl_s=60)
    total = loop.engine.num_free_blocks
    header = header_for(inbox, "r", 3)
    segments = inbox.on_header(header).segments
    assert loop.engine.num_free_blocks == total - 3
    payload = torch.randn(header.shape, dtype=inbox.dtype)
    flat, offset = payload.view(torch.uint8).numpy().reshape(-1), 0
    for segment in segments:  # as a transport fills them, in order
        segment[:] = flat[offset : offset + segment.nbytes]
        offset += segment.nbytes
    assert offset == header.nbytes
    inbox.on_done(header, True)
    transfer = asyncio.run(inbox.take("r", timeout_s=1))
    stored = loop.engine.kv_cache.pool[:, transfer.blocks]
    assert torch.equal(stored, payload)
    loop.call(loop.engine.kv.free, transfer.reservation)
    assert loop.engine.num_free_blocks == total
    inbox.close()


def test_blocks_cached_here_are_shared_and_left_out_of_the_transfer(loop):
    engine = loop.engine
    prompt = list(range(3, 3 + 2 * 16))  # two full blocks, cached once computed
    engine_params = SamplingParams(max_tokens=1, temperature=0)
    loop.call(lambda: engine.generate([prompt], engine_params))
    inbox = KVInbox(loop, landed_ttl_s=60)
    total = engine.num_free_blocks
    header = header_for(inbox, "r", 3)
    header.block_hashes = hash_blocks(prompt + [7] * 16, 16)  # the same two blocks, then a new one
    accepted = inbox.on_header(header)
    assert accepted.skip_blocks == 2
    assert sum(s.nbytes for s in accepted.segments) == header.nbytes // 3  # one block's bytes
    cached = [engine.block_manager.hash_to_block[h] for h in header.block_hashes[:2]]
    assert inbox._transfers["r"].blocks[:2] == cached  # shared, not copied: one fresh block only
    inbox.on_done(header, False)
    wait_for_free(loop, total)
    inbox.close()


def test_segments_are_the_pool_itself_per_layer_and_run_of_adjacent_blocks(loop):
    inbox = KVInbox(loop, landed_ttl_s=60)
    pool = loop.engine.kv_cache.pool
    blocks = [5, 6, 9]  # runs [5, 6] and [9]
    segments = loop.engine.kv.landing(Reservation(blocks))
    assert len(segments) == pool.shape[0] * 2
    flat = torch.arange(pool[:, blocks].numel(), dtype=pool.dtype).view(pool[:, blocks].shape)
    data, offset = flat.view(torch.uint8).numpy().reshape(-1), 0
    for segment in segments:
        segment[:] = data[offset : offset + segment.nbytes]
        offset += segment.nbytes
    assert offset == data.nbytes
    assert torch.equal(pool[:, blocks], flat)  # written in place: no copy stands between
    inbox.close()


def test_a_failed_transfer_and_an_unclaimed_one_free_their_blocks(loop):
    inbox = KVInbox(loop, landed_ttl_s=0.2)
    total = loop.engine.num_free_blocks
    failed = header_for(inbox, "failed", 2)
    inbox.on_header(failed)
    inbox.on_done(failed, False)
    wait_for_free(loop, total)

    unclaimed = header_for(inbox, "unclaimed", 2)
    inbox.on_header(unclaimed)
    inbox.on_done(unclaimed, True)
    assert loop.engine.num_free_blocks == total - 2
    wait_for_free(loop, total)  # the reaper frees it once the TTL passes
    with pytest.raises(TimeoutError):
        asyncio.run(inbox.take("unclaimed", timeout_s=0.1))
    inbox.close()


def test_refusals_reserve_nothing(loop):
    inbox = KVInbox(loop, landed_ttl_s=60)
    total = loop.engine.num_free_blocks
    wrong_shape = header_for(inbox, "a", 2)
    wrong_shape.shape[-1] += 1
    with pytest.raises(TransferRefused, match="does not fit"):
        inbox.on_header(wrong_shape)
    with pytest.raises(TransferRefused, match="no room"):
        inbox.on_header(header_for(inbox, "big", total + 1))  # could never fit: refused at once
    inbox.on_header(header_for(inbox, "dup", 1))
    with pytest.raises(TransferRefused, match="already here"):
        inbox.on_header(header_for(inbox, "dup", 1))
    assert loop.engine.num_free_blocks == total - 1
    inbox.close()


def test_a_full_pool_is_waited_on_until_blocks_free_or_the_deadline(loop):
    inbox = KVInbox(loop, landed_ttl_s=60)
    total = loop.engine.num_free_blocks
    held = loop.call(loop.engine.kv.reserve, total - 1)  # what running sequences would hold
    late = header_for(inbox, "late", 2)
    late.deadline_s = 0.2
    with pytest.raises(TransferRefused, match="within"):
        inbox.on_header(late)
    threading.Timer(0.2, lambda: loop.post(loop.engine.kv.free, held)).start()
    inbox.on_header(header_for(inbox, "waits", 2))  # accepted once the blocks are freed
    assert loop.engine.num_free_blocks == total - 2
    inbox.close()
