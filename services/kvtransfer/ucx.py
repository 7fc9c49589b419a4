"""The UCX transport, through ucxx: tag send/recv on endpoints with error handling on.

ucxx is asyncio-based, so each process runs one event loop on a thread of its own (the
"UCX runtime") and the blocking `send` hands coroutines to it. Senders cache one endpoint per
receiver and take turns on it; a failed or timed-out exchange aborts that endpoint (so no
late bytes land anywhere) and the next transfer makes a new one. Messages on one endpoint
arrive in order, so no tags need matching beyond the endpoint's own.

UCX must not see a fork after it starts: the worker starts it after its last fork (none).

Shutdown. ucxx hands UCX its listener's callback data (a dict on the Python listener) as a raw
pointer, and UCX's progress thread calls back through it on every connection request. Freeing
the listener freed the dict while the C++ listener could still take a request (it is destroyed
later, and writers reconnect at shutdown, their endpoints aborted), so the callback read a
cleared or freed dict: `KeyError: 'cb_func'`, or `SystemError ... dictobject.c` once its memory
held something else. Handlers that did start ran into an interpreter already shutting down
("cannot schedule new futures after shutdown"). So a closed receiver keeps its listener (it
refuses every new endpoint instead). At exit, the runtime's loop and ucxx's notifier thread
stop first, then ucxx's own exit handlers close the endpoints and stop UCX's progress thread,
all before Python finalizes. A Python thread still inside a ucxx call when finalization
begins dies taking the GIL back, in a forced unwind that ucxx's C++ `catch (...)` swallows,
and glibc aborts the process ("FATAL: exception not rethrown"): a store stopped under puts
did, 1 in ~20, its loop in an endpoint's abort that waited on a progress thread ucxx's
handlers had already stopped.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import os
import threading
import weakref

import numpy as np

from services import faults
from services.kvtransfer.base import (
    KVReceiver,
    KVSender,
    Payload,
    TransferError,
    TransferHeader,
    TransferRefused,
)

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # ucxx sets variables this UCX build ignores
# Measured here (bench/kv_transfer.py, /tmp/ucx_idle-style CPU checks):
# - 1 MiB TCP segments instead of 8 KiB: 64 MiB transfers go from 1.3 to ~2.6 GB/s (raw socket ~3).
# - Progress on UCX's own thread, with Python futures signalled by its notifier thread. The
#   other modes burn a core: "blocking" spins in its arm loop once an endpoint exists, and
#   without Python futures every pending receive is polled from the event loop.
# The environment still wins where it sets these.
os.environ.setdefault("UCX_TCP_TX_SEG_SIZE", "1m")
os.environ.setdefault("UCX_TCP_RX_SEG_SIZE", "1m")
os.environ.setdefault("UCXPY_PROGRESS_MODE", "thread")
os.environ.setdefault("UCXPY_ENABLE_PYTHON_FUTURE", "1")
# ucxx warns on stdout each time a burst of requests empties its futures pool ("No Futures
# available during getFuture()"), a hint it acts on itself: hundreds of lines an hour of load.
os.environ.setdefault("UCXX_LOG_LEVEL", "ERROR")
import ucxx  # noqa: E402

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 5.0
STOP_TIMEOUT_S = 5.0
# Closed receivers' listeners: kept for the process's life (see the module docstring).
_CLOSED_LISTENERS: list = []


class _Runtime:
    """The process's UCX event loop thread."""

    _instance: _Runtime | None = None
    _guard = threading.Lock()

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="ucx-runtime", daemon=True
        )
        self._thread.start()
        # ucxx closes its endpoints and stops UCX's progress thread from weakref finalizers,
        # which weakref runs from an exit handler registered at the process's first finalizer.
        # One made here registers it now, so this stop, registered after it, runs before it.
        weakref.finalize(self, lambda: None)
        atexit.register(self.stop)

    @classmethod
    def get(cls) -> _Runtime:
        with cls._guard:
            if cls._instance is None:
                cls._instance = _Runtime()
            return cls._instance

    def run(self, coro, timeout_s: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def stop(self) -> None:
        """At exit, before ucxx's own exit handlers and before Python finalizes: this loop and
        ucxx's notifier thread stop, so no Python thread is inside a ucxx call when Python
        finalizes (see the module docstring). ucxx's handlers then close the endpoints while
        UCX still progresses and stop its progress thread last. On a thread of its own, so a
        wedged call delays the exit by STOP_TIMEOUT_S at most."""
        stopper = threading.Thread(target=self._stop_threads, name="ucx-stop", daemon=True)
        stopper.start()
        stopper.join(STOP_TIMEOUT_S)
        if stopper.is_alive():
            log.warning("UCX's threads did not stop within %.0fs", STOP_TIMEOUT_S)

    def _stop_threads(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        ctx = ucxx.core._ctx
        notifier = getattr(ctx, "notifier_thread", None)
        if notifier is not None:
            ctx.worker.stop_request_notifier_thread()  # its wait returns at once
            notifier.join()


class UCXReceiver(KVReceiver):
    def start(self, host: str) -> str:
        runtime = _Runtime.get()
        self._closing = False
        self._endpoints: set = set()  # being served, touched on the runtime's loop only

        async def listen():
            return ucxx.create_listener(self._serve, endpoint_error_handling=True)

        self._listener = runtime.run(listen(), timeout_s=30)
        return f"ucx://{host}:{self._listener.port}"

    async def _serve(self, ep) -> None:
        if self._closing:
            ep.abort()
            return
        self._endpoints.add(ep)
        try:
            await self._serve_transfers(ep)
        finally:
            self._endpoints.discard(ep)

    async def _serve_transfers(self, ep) -> None:
        loop = asyncio.get_running_loop()
        while not self._closing:
            try:
                raw = await ep.recv_obj()
            except Exception:  # the sender closed or died between transfers
                return
            try:
                header = TransferHeader.decode(bytes(raw))
                accepted = await loop.run_in_executor(None, self.on_header, header)
            except TransferRefused as exc:
                await ep.send_obj(json.dumps({"ok": False, "error": str(exc)}).encode())
                continue
            except Exception as exc:
                log.exception("KV receiver failed to accept a transfer")
                await ep.send_obj(
                    json.dumps({"ok": False, "error": f"receiver error: {exc}"}).encode()
                )
                continue
            ok = False
            try:
                await ep.send_obj(
                    json.dumps(
                        {
                            "ok": True,
                            "skip_blocks": accepted.skip_blocks,
                            "segments": [s.nbytes for s in accepted.segments],
                        }
                    ).encode()
                )
                await asyncio.wait_for(
                    self._recv_segments(ep, accepted.segments), header.deadline_s
                )
                ok = True
            except Exception as exc:
                if self._closing:
                    log.info("KV transfer %s aborted: the receiver closed", header.request_id)
                else:
                    log.warning("KV transfer %s failed: %r", header.request_id, exc)
                ep.abort()
            finally:
                await loop.run_in_executor(None, self.on_done, header, ok)
            if not ok:
                return
            try:
                await ep.send_obj(b'{"ok": true}')
            except Exception:
                return

    @staticmethod
    async def _recv_segments(ep, segments) -> None:
        for segment in segments:  # in order: messages on one endpoint arrive in the order sent
            await ep.recv(segment)

    def close(self) -> None:
        """Refuses new endpoints and aborts those being served (a transfer on its way fails,
        and `on_done` hears of it). The listener is kept, not freed: see the module docstring."""
        _Runtime.get().run(self._close(), timeout_s=10)

    async def _close(self) -> None:
        self._closing = True
        for ep in list(self._endpoints):
            ep.abort()
        _CLOSED_LISTENERS.append(self._listener)
        # The aborted transfers' handlers end (and call on_done) on this loop's next turns.
        for _ in range(100):
            if not self._endpoints:
                return
            await asyncio.sleep(0.01)


class UCXSender(KVSender):
    def __init__(self):
        self._runtime = _Runtime.get()
        self._endpoints: dict[str, object] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    def send(
        self, host_port: str, header: TransferHeader, payload: Payload, timeout_s: float
    ) -> int:
        try:
            # The inner deadline fires first; the outer one guards against a wedged loop.
            return self._runtime.run(
                self._send(host_port, header, payload, timeout_s), timeout_s + 5
            )
        except TransferError:
            raise
        except Exception as exc:
            raise TransferError(f"KV transfer to {host_port} failed: {exc!r}") from None

    async def _send(
        self, host_port: str, header: TransferHeader, payload: Payload, timeout_s: float
    ) -> int:
        lock = self._locks.setdefault(host_port, asyncio.Lock())
        try:
            await asyncio.wait_for(lock.acquire(), timeout_s)
        except TimeoutError:
            raise TransferError(
                f"KV transfer to {host_port}: waited {timeout_s:.1f}s for the endpoint"
            ) from None
        try:
            ep = self._endpoints.pop(host_port, None)
            try:
                if ep is None:
                    host, port = host_port.rsplit(":", 1)
                    ep = await ucxx.create_endpoint(
                        host,
                        int(port),
                        endpoint_error_handling=True,
                        connect_timeout=min(timeout_s, CONNECT_TIMEOUT_S),
                    )
                nbytes = await asyncio.wait_for(
                    self._exchange(ep, host_port, header, payload), timeout_s
                )
                self._endpoints[host_port] = ep
                return nbytes
            except TransferRefused:
                self._endpoints[host_port] = ep  # the endpoint is fine; the receiver said no
                raise
            except Exception as exc:
                if ep is not None:
                    ep.abort()
                if isinstance(exc, asyncio.TimeoutError):
                    raise TransferError(
                        f"KV transfer to {host_port} timed out after {timeout_s:.1f}s"
                    ) from None
                raise TransferError(f"KV transfer to {host_port} failed: {exc!r}") from None
        finally:
            lock.release()

    @staticmethod
    async def _exchange(ep, host_port: str, header: TransferHeader, payload: Payload) -> int:
        await ep.send_obj(header.encode())
        reply = json.loads(bytes(await ep.recv_obj()))
        if not reply["ok"]:
            raise TransferRefused(f"KV transfer to {host_port} refused: {reply['error']}")
        payload = payload(reply.get("skip_blocks", 0))
        if faults.FAULTS.get("kv_stall_s"):
            await asyncio.sleep(faults.FAULTS["kv_stall_s"])
        ends = np.cumsum(reply["segments"])
        if (
            int(ends[-1]) if ends.size else 0
        ) != payload.nbytes:  # none: the receiver held every block
            raise TransferError(
                f"KV transfer to {host_port}: the receiver's segments do not add up to the payload"
            )
        await asyncio.gather(
            *(ep.send(payload[end - size : end]) for size, end in zip(reply["segments"], ends))
        )
        reply = json.loads(bytes(await ep.recv_obj()))
        if not reply["ok"]:
            raise TransferError(f"KV transfer to {host_port} failed: {reply.get('error')}")
        return payload.nbytes

    def close(self) -> None:
        for ep in self._endpoints.values():
            ep.abort()
        self._endpoints.clear()
