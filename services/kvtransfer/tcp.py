"""The plain-socket transport: the fallback where UCX is missing, and the baseline.

Messages are framed as an 8-byte big-endian length and the bytes; the payload is raw. The
sender keeps one connection per receiver (transfers to one receiver take turns on it); the
receiver serves each connection on a thread of its own.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import struct
import threading
import time

from services import faults
from services.kvtransfer.base import (
    KVReceiver,
    KVSender,
    Payload,
    TransferError,
    TransferHeader,
    TransferRefused,
)

log = logging.getLogger(__name__)
LENGTH = struct.Struct(">Q")
MAX_HEADER_BYTES = 16 << 20
IDLE_TIMEOUT_S = 3600.0  # a connection waiting between transfers


def _recv_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fills `view`; with a deadline (time.monotonic()), the whole read is bounded, not each recv."""
    while view:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the payload did not arrive before the deadline")
            sock.settimeout(remaining)
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        view = view[n:]


def _send_message(sock: socket.socket, raw: bytes) -> None:
    sock.sendall(LENGTH.pack(len(raw)) + raw)


def _recv_message(sock: socket.socket) -> bytes:
    head = bytearray(LENGTH.size)
    _recv_exact(sock, memoryview(head))
    (n,) = LENGTH.unpack(head)
    if n > MAX_HEADER_BYTES:
        raise ConnectionError(f"message of {n} bytes is too large")
    body = bytearray(n)
    _recv_exact(sock, memoryview(body))
    return bytes(body)


class TCPReceiver(KVReceiver):
    def start(self, host: str) -> str:
        self._listener = socket.create_server((host, 0))
        self._closed = False
        threading.Thread(target=self._accept, name="kv-tcp-accept", daemon=True).start()
        return f"tcp://{host}:{self._listener.getsockname()[1]}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(
                target=self._serve, args=(conn,), name="kv-tcp-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while not self._closed:
                try:
                    conn.settimeout(IDLE_TIMEOUT_S)
                    raw = _recv_message(conn)
                except (OSError, ConnectionError):
                    return
                if not self._receive_one(conn, raw):
                    return

    def _receive_one(self, conn: socket.socket, raw: bytes) -> bool:
        """One transfer; False when the connection is no longer usable."""
        try:
            header = TransferHeader.decode(raw)
            accepted = self.on_header(header)
        except TransferRefused as exc:
            return self._reply(conn, {"ok": False, "error": str(exc)})
        except Exception as exc:  # the receiver's own failure: refuse, keep serving
            log.exception("KV receiver failed to accept a transfer")
            return self._reply(conn, {"ok": False, "error": f"receiver error: {exc}"})
        ok = False
        try:
            deadline = time.monotonic() + header.deadline_s
            conn.settimeout(header.deadline_s)
            # A byte stream: the sender needs no segment sizes.
            _send_message(
                conn, json.dumps({"ok": True, "skip_blocks": accepted.skip_blocks}).encode()
            )
            for segment in accepted.segments:
                _recv_exact(conn, memoryview(segment).cast("B"), deadline)
            ok = True
        except (OSError, ConnectionError) as exc:
            log.warning("KV transfer %s failed: %s", header.request_id, exc)
        finally:
            self.on_done(header, ok)
        return ok and self._reply(conn, {"ok": True})

    @staticmethod
    def _reply(conn: socket.socket, reply: dict) -> bool:
        try:
            _send_message(conn, json.dumps(reply).encode())
            return True
        except OSError:
            return False

    def close(self) -> None:
        self._closed = True
        self._listener.close()


class PooledSender(KVSender):
    """Keeps one control connection per receiver; transfers to one receiver take turns on it
    (`_turn`), and each begins by offering its header (`_offer`)."""

    def __init__(self):
        self._connections: dict[str, socket.socket] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    @contextlib.contextmanager
    def _turn(self, host_port: str, timeout_s: float):
        with self._guard:
            lock = self._locks.setdefault(host_port, threading.Lock())
        if not lock.acquire(timeout=timeout_s):
            raise TransferError(
                f"KV transfer to {host_port}: waited {timeout_s:.1f}s for the connection"
            )
        try:
            yield
        finally:
            lock.release()

    def _offer(
        self, host_port: str, header: TransferHeader, deadline: float
    ) -> tuple[socket.socket, dict]:
        """Sends the header on the receiver's connection (opened if there is none); returns the
        connection and the receiver's acceptance. A refusal keeps the connection for the next
        transfer and raises TransferRefused; any other failure closes it and raises."""
        conn = self._connections.pop(host_port, None)
        if conn is None:
            host, port = host_port.rsplit(":", 1)
            conn = socket.create_connection(
                (host, int(port)), timeout=max(deadline - time.monotonic(), 0.01)
            )
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            conn.settimeout(max(deadline - time.monotonic(), 0.01))
            _send_message(conn, header.encode())
            reply = json.loads(_recv_message(conn))
        except BaseException:
            conn.close()
            raise
        if not reply["ok"]:
            self._connections[host_port] = conn
            raise TransferRefused(f"KV transfer to {host_port} refused: {reply['error']}")
        return conn, reply

    def close(self) -> None:
        for conn in self._connections.values():
            conn.close()
        self._connections.clear()


class TCPSender(PooledSender):
    def send(
        self, host_port: str, header: TransferHeader, payload: Payload, timeout_s: float
    ) -> int:
        deadline = time.monotonic() + timeout_s
        with self._turn(host_port, timeout_s):
            conn = None
            try:
                conn, reply = self._offer(host_port, header, deadline)
                data = payload(reply.get("skip_blocks", 0))
                faults.delay("kv_stall_s")
                conn.settimeout(max(deadline - time.monotonic(), 0.01))
                conn.sendall(memoryview(data).cast("B"))
                reply = json.loads(_recv_message(conn))
                if not reply["ok"]:
                    raise TransferError(f"KV transfer to {host_port} failed: {reply.get('error')}")
                self._connections[host_port] = conn  # reusable: the exchange completed
                return data.nbytes
            except (OSError, ConnectionError, ValueError) as exc:
                if conn is not None:
                    conn.close()
                raise TransferError(f"KV transfer to {host_port} failed: {exc}") from None
