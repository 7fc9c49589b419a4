"""The KV cache store stopped (SIGTERM) while writers push blocks to it over UCX exits cleanly.

Issue 26 saw `SystemError ... dictobject.c` from a UCX listener callback as the store stopped.
ucxx gives UCX its listener's callback data (a dict) as a raw pointer; freeing the listener
freed the dict while UCX's progress thread could still deliver a connection request, and
writers reconnect exactly then (the store aborts their endpoints). The same race shows as
`KeyError: 'cb_func'` (a cleared dict), and handlers that ran after the interpreter began to
shut down failed with "cannot schedule new futures". services/kvtransfer/ucx.py keeps a closed
receiver's listener and stops UCX's progress before Python finalizes.
"""

from __future__ import annotations

import signal
import threading
import time
import uuid

import grpc
import numpy as np

from deploy.processes import start_service
from services.kvtransfer import Senders, TransferHeader
from tandem.v1 import kvcache_pb2, kvcache_pb2_grpc

NUM_WRITERS = 4
SHAPE = [2, 4, 2, 16, 2, 8]  # [layers, blocks, 2, block_size, kv_heads, head_dim]
SIGNS_OF_THE_RACE = ("SystemError", "listener callback", "cannot schedule new futures")


def test_a_store_stopped_under_puts_exits_without_listener_callback_errors(tmp_path):
    log = open(tmp_path / "store.log", "w+")
    store, address = start_service(
        "services.kvcache",
        "--host",
        "127.0.0.1",
        "--dram-bytes",
        str(64 << 20),
        "--disk-dir",
        str(tmp_path / "disk"),
        stderr=log,
    )
    try:
        with grpc.insecure_channel(address) as channel:
            stats = kvcache_pb2_grpc.KVCacheStub(channel).Stats(
                kvcache_pb2.StatsRequest(), timeout=10
            )
        assert stats.kv_address.startswith("ucx://")
        stop, num_puts = threading.Event(), [0] * NUM_WRITERS

        def write(writer: int) -> None:
            senders = Senders()
            payload = np.zeros(SHAPE, np.float32).view(np.uint8).reshape(-1)
            while not stop.is_set():
                header = TransferHeader(
                    request_id=f"put-{uuid.uuid4().hex}",
                    nbytes=payload.nbytes,
                    deadline_s=2,
                    shape=SHAPE,
                    dtype="float32",
                    block_hashes=[writer << 40 | num_puts[writer] << 3 | j for j in range(4)],
                    namespace="shutdown-test",
                )
                try:
                    senders.send(stats.kv_address, header, lambda skip: payload, 2)
                except Exception:  # the store is stopping: the next put reconnects
                    pass
                num_puts[writer] += 1
            senders.close()

        writers = [threading.Thread(target=write, args=(w,)) for w in range(NUM_WRITERS)]
        for thread in writers:
            thread.start()
        deadline = time.monotonic() + 30
        while sum(num_puts) < 50 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sum(num_puts) >= 50, "the writers' puts did not flow"
        store.send_signal(signal.SIGTERM)
        exit_code = store.wait(timeout=30)
        stop.set()
        for thread in writers:
            thread.join(timeout=30)
    finally:
        store.kill()
        stop.set()
    log.seek(0)
    text = log.read()
    assert exit_code == 0, text[-2000:]
    for sign in SIGNS_OF_THE_RACE:
        assert sign not in text, text[-4000:]
