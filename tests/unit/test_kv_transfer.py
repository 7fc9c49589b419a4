"""KV transports (UCX, plain TCP and Mooncake's Transfer Engine): bytes land intact, refusals and dead senders are
reported, and the receiver learns of every failed transfer so it can free its blocks."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from services.kvtransfer import (
    Accepted,
    Senders,
    TransferError,
    TransferHeader,
    TransferRefused,
    create_receiver,
)

pytestmark = pytest.mark.parametrize("transport", ["ucx", "tcp", "mooncake"])


class Inbox:
    """A receiver's callbacks: a buffer per accepted transfer, and each outcome."""

    def __init__(self, refuse: bool = False, cuts: tuple[int, ...] = ()):
        self.refuse = refuse
        self.cuts = cuts  # where the receiver splits the payload into segments
        self.skip_blocks = 0  # leading blocks it claims to hold (shape[1]: bytes per block here)
        self.buffers: dict[str, np.ndarray] = {}
        self.done: dict[str, bool] = {}
        self.accepted = threading.Event()
        self.finished = threading.Event()

    def on_header(self, header: TransferHeader) -> Accepted:
        if self.refuse:
            raise TransferRefused("no free KV blocks")
        nbytes = (
            header.nbytes - self.skip_blocks * header.shape[1]
            if self.skip_blocks
            else header.nbytes
        )
        buffer = self.buffers[header.request_id] = np.zeros(nbytes, np.uint8)
        self.accepted.set()
        cuts = sorted({0, nbytes, *(min(c, nbytes) for c in self.cuts)})
        return Accepted([buffer[a:b] for a, b in zip(cuts, cuts[1:])], self.skip_blocks)

    def on_done(self, header: TransferHeader, ok: bool) -> None:
        self.done[header.request_id] = ok
        self.finished.set()


@pytest.fixture
def receiver_of(transport):
    made = []

    def make(inbox: Inbox):
        receiver = create_receiver(transport, inbox.on_header, inbox.on_done)
        made.append(receiver)
        return receiver.start("127.0.0.1")

    yield make
    for receiver in made:
        receiver.close()


def test_blocks_arrive_byte_for_byte_and_the_connection_is_reused(transport, receiver_of):
    # segments of uneven sizes, as a pool's block runs are
    inbox = Inbox(cuts=(4096, 4097, 300_000))
    address = receiver_of(inbox)
    senders = Senders()
    rng = np.random.default_rng(0)
    payloads = {
        f"r{i}": rng.integers(0, 256, size=(1 << 20) + i * 4099, dtype=np.uint8) for i in range(3)
    }
    for request_id, payload in payloads.items():
        senders.send(
            address,
            TransferHeader(request_id, payload.nbytes, deadline_s=10),
            lambda _: payload,
            timeout_s=10,
        )
    senders.close()
    assert inbox.done == {rid: True for rid in payloads}
    for request_id, payload in payloads.items():
        assert np.array_equal(inbox.buffers[request_id], payload)


def test_blocks_the_receiver_holds_are_left_out_of_the_payload(transport, receiver_of):
    inbox = Inbox(cuts=(1000,))
    inbox.skip_blocks = 3
    address = receiver_of(inbox)
    # 10 blocks of 2,048 bytes
    blocks = np.arange(10 * 512, dtype=np.uint32).view(np.uint8).reshape(10, -1)
    header = TransferHeader("r", blocks.nbytes, deadline_s=10, shape=[1, blocks.shape[1]])
    senders = Senders()
    sent = senders.send(address, header, lambda skip: blocks[skip:].reshape(-1), timeout_s=10)
    senders.close()
    assert sent == 7 * blocks.shape[1] and inbox.done == {"r": True}
    assert np.array_equal(inbox.buffers["r"], blocks[3:].reshape(-1))


def test_a_refused_transfer_raises_and_the_receiver_keeps_serving(transport, receiver_of):
    inbox = Inbox(refuse=True)
    address = receiver_of(inbox)
    senders = Senders()
    payload = np.ones(4096, np.uint8)
    with pytest.raises(TransferRefused, match="no free KV blocks"):
        senders.send(
            address,
            TransferHeader("r", payload.nbytes, deadline_s=5),
            lambda _: payload,
            timeout_s=5,
        )
    inbox.refuse = False
    senders.send(
        address, TransferHeader("r2", payload.nbytes, deadline_s=5), lambda _: payload, timeout_s=5
    )
    senders.close()
    assert inbox.done == {"r2": True}


def test_an_unreachable_receiver_fails_within_the_deadline(transport):
    senders = Senders()
    t0 = time.monotonic()
    with pytest.raises(TransferError):
        senders.send(
            f"{transport}://127.0.0.1:1",
            TransferHeader("r", 8, deadline_s=2),
            lambda _: np.zeros(8, np.uint8),
            2,
        )
    assert time.monotonic() - t0 < 60  # a hang guard, not a timing figure


STALLING_SENDER = """
import sys, numpy as np
from services.kvtransfer import Senders, TransferHeader
payload = np.zeros(1 << 20, np.uint8)
Senders().send(sys.argv[1], TransferHeader("stalled", payload.nbytes, deadline_s=float(sys.argv[2])), lambda _: payload,
               600)
"""


@pytest.mark.parametrize(
    "kill", [True, False], ids=["sender-killed", "sender-stalls-past-deadline"]
)
def test_the_receiver_hears_of_a_transfer_that_never_completes(transport, receiver_of, kill):
    inbox = Inbox()
    address = receiver_of(inbox)
    env = dict(os.environ, TANDEM_FAULTS="kv_stall_s=600")
    deadline_s = 600 if kill else 1.0
    sender = subprocess.Popen(
        [sys.executable, "-c", STALLING_SENDER, address, str(deadline_s)],
        env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )
    try:
        assert inbox.accepted.wait(60), "the sender never reached the receiver"
        if kill:
            sender.kill()
        assert inbox.finished.wait(30), "the receiver never gave up on the transfer"
        assert inbox.done == {"stalled": False}
    finally:
        sender.kill()
        sender.wait()
