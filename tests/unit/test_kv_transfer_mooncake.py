"""The Mooncake transport's own guarantees: a one-sided write that lands after the receiver gave
up never reaches the blocks it freed, its staging region is reused only once that write has
ended, and a transfer its staging buffer cannot hold is refused."""

from __future__ import annotations

import json
import socket
import time

import numpy as np
import pytest

from services.kvtransfer import Senders, TransferHeader, TransferRefused
from services.kvtransfer import mooncake_te as mooncake
from services.kvtransfer.tcp import _recv_message, _send_message
from tests.unit.test_kv_transfer import Inbox

STAGING_BYTES = 1 << 20


def wait_until(predicate, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture
def receiver():
    inbox = Inbox()
    receiver = mooncake.MooncakeReceiver(inbox.on_header, inbox.on_done, STAGING_BYTES)
    address = receiver.start("127.0.0.1")
    yield receiver, inbox, address
    receiver.close()


@pytest.mark.parametrize("end", ["sender-says-written", "sender-closes"])
def test_a_write_landing_past_the_deadline_never_reaches_the_blocks(receiver, end):
    receiver, inbox, address = receiver
    host, port = address.split("://")[1].rsplit(":", 1)
    conn = socket.create_connection((host, int(port)))
    _send_message(conn, TransferHeader("late", 4096, deadline_s=0.2).encode())
    accept = json.loads(_recv_message(conn))
    assert inbox.finished.wait(30) and inbox.done == {"late": False}  # blocks freed at the deadline
    # the sender's write may still be running: its region stays out of use
    assert receiver.staging.num_free_bytes == STAGING_BYTES - 4096
    late = np.full(4096, 0xFF, np.uint8)
    te = mooncake._Engine.get("127.0.0.1").te
    assert te.transfer_sync_write(accept["session"], late.ctypes.data, accept["address"], 4096) == 0
    if end == "sender-says-written":
        _send_message(conn, b'{"written": true}')
        assert json.loads(_recv_message(conn)) == {
            "ok": False,
            "error": "the payload came past the deadline",
        }
    conn.close()
    wait_until(lambda: receiver.staging.num_free_bytes == STAGING_BYTES, "the region's release")
    assert not inbox.buffers["late"].any()


def test_a_transfer_larger_than_the_staging_buffer_is_refused(receiver):
    receiver, inbox, address = receiver
    payload = np.ones(2 * STAGING_BYTES, np.uint8)
    senders = Senders()
    with pytest.raises(TransferRefused, match="staging buffer"):
        senders.send(
            address,
            TransferHeader("large", payload.nbytes, deadline_s=5),
            lambda _: payload,
            timeout_s=5,
        )
    senders.close()
    assert inbox.done == {} and receiver.staging.num_free_bytes == STAGING_BYTES
