"""Decode-side prefix reuse: in a 1P+1D stack the next turn of a conversation moves only the
KV blocks the decode worker lacks, and the reply is the colocated stack's; a repeated prompt
of whole blocks moves nothing and still succeeds."""

from __future__ import annotations

import json
import urllib.request

import pytest

from deploy.processes import named_address
from deploy.stack import start_stack

BLOCK = 16


def complete(address: str, prompt: list[int]) -> dict:
    request = urllib.request.Request(
        f"http://{address}/v1/completions",
        headers={"Content-Type": "application/json"},
        data=json.dumps(
            {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        ).encode(),
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


def sent_bytes(stack) -> float:
    [prefill] = stack.workers["prefill"]
    page = (
        urllib.request.urlopen(
            f"http://{named_address(stack.worker_processes[prefill], 'metrics')}/metrics",
            timeout=10,
        )
        .read()
        .decode()
    )
    return next(
        (
            float(line.split()[1])
            for line in page.splitlines()
            if line.startswith('tandem:kv_transfer_bytes_total{direction="sent"}')
        ),
        0.0,
    )


@pytest.mark.parametrize("transport", ["ucx", "tcp"])
def test_the_second_turn_moves_only_the_blocks_the_decode_worker_lacks(
    chat_checkpoint, services_stack, transport
):
    stack = start_stack(
        str(chat_checkpoint),
        topology="disaggregated",
        worker_args=("--kv-cache-bytes", str(8 << 20), "--kv-transport", transport),
    )
    try:
        first_turn = [(i * 7) % 370 + 3 for i in range(5 * BLOCK + 3)]  # 5 full blocks and 3 tokens
        second_turn = first_turn + [(i * 11) % 370 + 3 for i in range(2 * BLOCK)]
        complete(stack.openai_address, first_turn)
        first_bytes = sent_bytes(stack)
        bytes_per_block = first_bytes / 6
        reply = complete(stack.openai_address, second_turn)
        second_bytes = sent_bytes(stack) - first_bytes
        # 8 blocks in all; the decode worker holds the first turn's 5 full ones already.
        assert second_bytes == (8 - 5) * bytes_per_block
        colocated = complete(services_stack.openai_address, second_turn)
        assert reply["choices"][0]["text"] == colocated["choices"][0]["text"]
        # A prompt of whole blocks, again: the decode worker holds every block, nothing moves,
        # and the transfer still completes (an empty payload).
        whole = [(i * 13) % 370 + 3 for i in range(4 * BLOCK)]
        first = complete(stack.openai_address, whole)
        before = sent_bytes(stack)
        again = complete(stack.openai_address, whole)
        assert (
            sent_bytes(stack) == before
            and again["choices"][0]["text"] == first["choices"][0]["text"]
        )
    finally:
        stack.stop()
