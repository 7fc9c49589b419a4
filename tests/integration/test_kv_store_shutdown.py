"""The KV cache store stopped (SIGTERM) while writers push blocks to it over UCX exits cleanly.

Issue 26 saw `SystemError ... dictobject.c` from a UCX listener callback as the store stopped.
ucxx gives UCX its listener's callback data (a dict) as a raw pointer; freeing the listener
freed the dict while UCX's progress thread could still deliver a connection request, and
writers reconnect exactly then (the store aborts their endpoints). The same race shows as
`KeyError: 'cb_func'` (a cleared dict), and handlers that ran after the interpreter began to
shut down failed with "cannot schedule new futures". And the loop's thread, still inside a ucxx call
(an endpoint's abort waiting on a progress thread ucxx's exit handlers had stopped) when Python
finalized, aborted the store ("FATAL: exception not rethrown", exit -6, 1 run in ~20).
services/kvtransfer/ucx.py keeps a closed receiver's listener and, at exit, stops its loop and
ucxx's notifier thread before ucxx's handlers stop UCX's progress thread.
"""

from __future__ import annotations

import signal
import subprocess
import sys
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


# One UCX transfer in a process of its own, then what its exit handler does.
STOP_AT_EXIT = """
import threading
import numpy as np
from services.kvtransfer import Accepted, Senders, TransferHeader, create_receiver
from services.kvtransfer.ucx import _Runtime

buffer = np.zeros(64, np.uint8)
receiver = create_receiver("ucx", lambda header: Accepted([buffer]), lambda header, ok: None)
address = receiver.start("127.0.0.1")
header = TransferHeader(request_id="r", nbytes=64, deadline_s=5, shape=[64], dtype="uint8")
Senders().send(address, header, lambda skip: np.ones(64, np.uint8), 5)
assert buffer.sum() == 64
print(sorted(thread.name for thread in threading.enumerate()))
_Runtime.get().stop()
print(sorted(thread.name for thread in threading.enumerate()))
"""
UCX_THREADS = ("ucx-runtime", "UCX-Py Async Notifier Thread")


def test_ucx_threads_that_call_into_python_are_stopped_before_it_finalizes():
    out = subprocess.run(
        [sys.executable, "-c", STOP_AT_EXIT], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    before, after = out.stdout.strip().splitlines()[-2:]
    for name in UCX_THREADS:
        assert f"'{name}'" in before and f"'{name}'" not in after, (before, after)
