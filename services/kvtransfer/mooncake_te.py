"""The Mooncake transport: KV bytes through Mooncake's Transfer Engine (`mooncake.engine`), over
its "tcp" protocol here (RDMA where the CUDA build and the NICs are).

Control runs on a plain socket in tcp.py's framing; the payload goes through the engines, a
one-sided write from the sender's memory into the receiver's:
1. sender -> receiver: the header.
2. receiver -> sender: refuse, or accept with where to write: the receiver's engine session
   (`host:rpc_port`, Mooncake's P2P handshake: no metadata server) and a region of its staging
   buffer, registered with its engine once at start.
3. the sender writes the payload there (`transfer_submit_write`, polled under its deadline).
   Mooncake's TCP protocol (v2, 0.3.13) reports a write complete only once the bytes are in the
   receiver's memory.
4. sender -> receiver: "written"; the receiver copies the region into the segments, calls
   `on_done(ok=True)` and acks.

Why a staging region rather than writing straight into the reserved blocks, as SGLang's and
vLLM's Mooncake connectors do with a registered KV pool: a one-sided write cannot be called
back. A sender that stalls past the receiver's deadline would land its bytes in blocks the
receiver has freed and given to another sequence: wrong tokens. Here a failed transfer frees
its blocks at once (`on_done(ok=False)`), and its region is reused only once the sender's write
has ended: the sender keeps the control connection open until its write returns (a reaper
thread watches writes abandoned at the deadline) and then closes it, and a sender that dies
closes it along with its data connection. The cost is one memcpy on the receiver. A transfer
the staging buffer has no room for is refused, as one the pool has no room for is.

Mooncake must not see a fork after it starts: the engine starts with the first receiver or the
first send.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np

from services import faults
from services.kvtransfer.base import (
    Payload,
    TransferError,
    TransferHeader,
    TransferRefused,
    as_bytes,
)
from services.kvtransfer.tcp import (
    IDLE_TIMEOUT_S,
    PooledSender,
    TCPReceiver,
    _recv_message,
    _send_message,
)

log = logging.getLogger(__name__)
PROTOCOL = "tcp"  # "rdma" with the CUDA build (mooncake-transfer-engine) and RDMA NICs
STAGING_BYTES = 1 << 30  # virtual: pages are backed once a transfer first uses them
ALIGN = 4096
POLL_S = (50e-6, 2e-3)  # a write's status: first poll, then doubling up to this
REAP_S = 0.02


class _Engine:
    """The process's Transfer Engine, shared by its receiver and senders."""

    _instance: _Engine | None = None
    _guard = threading.Lock()

    def __init__(self, host: str):
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
        from mooncake.engine import TransferEngine

        self.te = TransferEngine()
        if self.te.initialize(host, "P2PHANDSHAKE", PROTOCOL, "") != 0:
            raise TransferError(f"Mooncake's Transfer Engine did not start on {host}")
        self.session = f"{host}:{self.te.get_rpc_port()}"

    @classmethod
    def get(cls, host: str) -> _Engine:
        """The engine, started on `host` (the address peers reach this process at) if it is not yet."""
        with cls._guard:
            if cls._instance is None:
                cls._instance = _Engine(host)
            return cls._instance


class Staging:
    """The receiver's registered buffer, handed out in page-aligned regions (first fit)."""

    def __init__(self, te, nbytes: int):
        self.buffer = np.zeros(nbytes, np.uint8)  # calloc'd: untouched pages cost no memory
        self.address = self.buffer.ctypes.data
        if te.register_memory(self.address, nbytes) != 0:
            raise TransferError(f"Mooncake would not register a {nbytes}-byte staging buffer")
        self._free = [(0, nbytes)]  # (offset, size), by offset, never adjacent
        self._lock = threading.Lock()

    @property
    def num_free_bytes(self) -> int:
        with self._lock:
            return sum(size for _, size in self._free)

    def allocate(self, nbytes: int) -> int | None:
        """The offset of a region of `nbytes`, or None when none is free."""
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        with self._lock:
            for i, (offset, free) in enumerate(self._free):
                if free >= size:
                    self._free[i : i + 1] = [(offset + size, free - size)] if free > size else []
                    return offset
        return None

    def release(self, offset: int, nbytes: int) -> None:
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        with self._lock:
            extents = sorted([*self._free, (offset, size)])
            merged = [extents[0]]
            for start, length in extents[1:]:
                last_start, last_length = merged[-1]
                if last_start + last_length == start:
                    merged[-1] = (last_start, last_length + length)
                else:
                    merged.append((start, length))
            self._free = merged


class MooncakeReceiver(TCPReceiver):
    """tcp.py's listener for control; the payload lands in the staging buffer."""

    def __init__(self, on_header, on_done, staging_bytes: int = STAGING_BYTES):
        super().__init__(on_header, on_done)
        self.staging_bytes = staging_bytes

    def start(self, host: str) -> str:
        self._te = _Engine.get(host)
        self.staging = Staging(self._te.te, self.staging_bytes)
        return "mooncake://" + super().start(host).split("://", 1)[1]

    def _receive_one(self, conn: socket.socket, raw: bytes) -> bool:
        try:
            header = TransferHeader.decode(raw)
        except TransferRefused as exc:
            return self._reply(conn, {"ok": False, "error": str(exc)})
        offset = self.staging.allocate(header.nbytes)
        if offset is None:
            return self._reply(
                conn,
                {
                    "ok": False,
                    "error": f"no room in the {self.staging_bytes}-byte staging buffer for "
                    f"{header.nbytes} bytes ({self.staging.num_free_bytes} free)",
                },
            )
        try:
            accepted = self.on_header(header)
        except Exception as exc:
            self.staging.release(offset, header.nbytes)
            if isinstance(exc, TransferRefused):
                return self._reply(conn, {"ok": False, "error": str(exc)})
            log.exception("KV receiver failed to accept a transfer")
            return self._reply(conn, {"ok": False, "error": f"receiver error: {exc}"})
        nbytes = sum(segment.nbytes for segment in accepted.segments)
        ok = said_written = timed_out = False
        try:
            deadline = time.monotonic() + header.deadline_s
            conn.settimeout(header.deadline_s)
            accept = {
                "ok": True,
                "skip_blocks": accepted.skip_blocks,
                "session": self._te.session,
                "address": self.staging.address + offset,
                "nbytes": nbytes,
            }
            _send_message(conn, json.dumps(accept).encode())
            conn.settimeout(max(deadline - time.monotonic(), 0.001))
            _recv_message(conn)  # "written": the sender's write has ended, and succeeded
            said_written = True
            if time.monotonic() <= deadline:
                staged = self.staging.buffer[offset : offset + nbytes]
                for segment in accepted.segments:
                    np.copyto(segment, staged[: segment.nbytes])
                    staged = staged[segment.nbytes :]
                ok = True
        except TimeoutError:
            log.warning(
                "KV transfer %s: no payload within %.1fs", header.request_id, header.deadline_s
            )
            timed_out = True
        except (OSError, ConnectionError) as exc:  # the sender closed: its write has ended
            log.warning("KV transfer %s failed: %r", header.request_id, exc)
        finally:
            self.on_done(header, ok)
        if timed_out:  # the sender's write may still be running: its region waits for its end
            said_written = self._wait_for_the_write(conn)
        self.staging.release(offset, header.nbytes)
        if ok:
            return self._reply(conn, {"ok": True})
        if said_written:
            self._reply(conn, {"ok": False, "error": "the payload came past the deadline"})
        return False

    def close(self) -> None:
        super().close()
        # Writes still on their way are refused from here (Mooncake checks each write's address).
        self._te.te.unregister_memory(self.staging.address)

    @staticmethod
    def _wait_for_the_write(conn: socket.socket) -> bool:
        """Blocks until the sender says its write ended (True) or closes the connection."""
        try:
            conn.settimeout(IDLE_TIMEOUT_S)
            _recv_message(conn)
            return True
        except (OSError, ConnectionError):
            return False


class _Reaper:
    """Writes abandoned at their deadline: each keeps its payload alive and its control
    connection open until Mooncake says the write has ended, then closes the connection."""

    def __init__(self, te):
        self.te = te
        self._writes: list[tuple[object, np.ndarray, socket.socket]] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name="kv-mooncake-reaper", daemon=True).start()

    def watch(self, batch, payload: np.ndarray, conn: socket.socket) -> None:
        """`batch`: a batch id, or the future of one still being submitted."""
        with self._lock:
            self._writes.append((batch, payload, conn))

    def _run(self) -> None:
        while True:
            time.sleep(REAP_S)
            with self._lock:
                writes, self._writes = self._writes, []
            for batch, payload, conn in writes:
                if not _write_ended(self.te, batch):
                    self.watch(batch, payload, conn)
                    continue
                conn.close()


def _write_ended(te, batch) -> bool:
    if hasattr(batch, "done"):  # still submitting
        if not batch.done():
            return False
        if batch.exception() is not None or batch.result() == 0:
            return True
        batch = batch.result()
    return te.transfer_check_status(batch) != 0


class MooncakeSender(PooledSender):
    """Control on one pooled connection per receiver (tcp.py's), the bytes through Mooncake."""

    def __init__(self):
        super().__init__()
        # Submitting a write to a new session runs Mooncake's handshake, which can block: it runs
        # here, so the caller keeps its deadline.
        self._submits = ThreadPoolExecutor(4, thread_name_prefix="kv-mooncake-submit")
        self._reaper: _Reaper | None = None

    def send(
        self, host_port: str, header: TransferHeader, payload: Payload, timeout_s: float
    ) -> int:
        deadline = time.monotonic() + timeout_s
        with self._turn(host_port, timeout_s):
            conn = None
            try:
                conn, reply = self._offer(host_port, header, deadline)
                data = as_bytes(payload(reply.get("skip_blocks", 0)))
                faults.delay("kv_stall_s")
                if time.monotonic() >= deadline:
                    raise TransferError(
                        f"KV transfer to {host_port} timed out after {timeout_s:.1f}s"
                    )
                if data.nbytes != reply["nbytes"]:
                    raise TransferError(
                        f"KV transfer to {host_port}: the receiver's segments do not add up to "
                        "the payload"
                    )
                if data.nbytes and not self._write(conn, reply, data, deadline):
                    conn = None  # the reaper closes it once the write has ended
                    raise TransferError(
                        f"KV transfer to {host_port} timed out after {timeout_s:.1f}s"
                    )
                conn.settimeout(max(deadline - time.monotonic(), 0.01))
                _send_message(conn, b'{"written": true}')
                reply = json.loads(_recv_message(conn))
                if not reply["ok"]:
                    raise TransferError(f"KV transfer to {host_port} failed: {reply.get('error')}")
                self._connections[host_port] = conn  # reusable: the exchange completed
                conn = None
                return data.nbytes
            except (OSError, ConnectionError, ValueError, KeyError) as exc:
                raise TransferError(f"KV transfer to {host_port} failed: {exc!r}") from None
            finally:
                if conn is not None:
                    conn.close()

    def _write(self, conn: socket.socket, reply: dict, data: np.ndarray, deadline: float) -> bool:
        """Writes `data` to the receiver's region; False when the deadline passed first (the
        write is then the reaper's). Raises TransferError when Mooncake fails it."""
        te = _Engine.get(conn.getsockname()[0]).te
        if self._reaper is None:
            self._reaper = _Reaper(te)
        session = reply["session"]
        submit = self._submits.submit(
            te.transfer_submit_write, session, data.ctypes.data, reply["address"], data.nbytes
        )
        try:
            batch = submit.result(max(deadline - time.monotonic(), 0))
        except FutureTimeout:
            self._reaper.watch(submit, data, conn)
            return False
        if batch == 0:
            raise TransferError(f"Mooncake would not write to {session}")
        poll_s = POLL_S[0]
        while (status := te.transfer_check_status(batch)) == 0:
            if time.monotonic() >= deadline:
                self._reaper.watch(batch, data, conn)
                return False
            time.sleep(poll_s)
            poll_s = min(poll_s * 2, POLL_S[1])
        if status < 0:
            raise TransferError(f"Mooncake's write to {session} failed (status {status})")
        return True
