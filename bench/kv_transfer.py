"""KV transfer throughput: tandem's UCX, TCP and Mooncake transports against a raw socket, 1 MiB
and 64 MiB.

    .venv/bin/python bench/kv_transfer.py [--reps-small 40] [--reps-large 4]

Each receiver runs in a process of its own (as a decode worker would), started from this
file with `--receiver ucx|tcp|mooncake|raw`; the sender times whole transfers, header to ack
(Mooncake: header, accept, the Transfer Engine's write, "written", ack). The raw socket is the
floor: a length, the bytes, a one-byte ack, nothing else. bench/disagg.py runs this too, so its
report carries these figures.
"""

from __future__ import annotations

import argparse
import os
import socket
import struct
import subprocess
import sys
import time

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SIZES = {"1 MiB": 1 << 20, "64 MiB": 64 << 20}
TRANSPORTS = ("ucx", "tcp", "mooncake", "raw")


def serve_receiver(transport: str) -> None:
    """A receiver that keeps one buffer per size and prints its address."""
    buffers: dict[int, np.ndarray] = {}

    def buffer(nbytes: int) -> np.ndarray:
        if nbytes not in buffers:
            buffers[nbytes] = np.empty(nbytes, np.uint8)
        return buffers[nbytes]

    if transport == "raw":
        listener = socket.create_server(("127.0.0.1", 0))
        print(f"receiver ready on raw://127.0.0.1:{listener.getsockname()[1]}", flush=True)
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = bytearray(8)
        while conn.recv_into(head, 8, socket.MSG_WAITALL) == 8:
            (n,) = struct.unpack(">Q", head)
            view = memoryview(buffer(n))
            while view:
                view = view[conn.recv_into(view) :]
            conn.sendall(b"k")
        return
    from services.kvtransfer import Accepted, create_receiver

    receiver = create_receiver(
        transport, lambda h: Accepted([buffer(h.nbytes)]), lambda h, ok: None
    )
    print(f"receiver ready on {receiver.start('127.0.0.1')}", flush=True)
    sys.stdin.read()  # until the parent closes our stdin


def start_receiver(transport: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--receiver", transport],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
    )
    line = proc.stdout.readline()
    if " ready on " not in line:
        proc.kill()
        raise RuntimeError(f"{transport} receiver did not start")
    return proc, line.split(" ready on ")[1].strip()


def measure(transport: str, reps: dict[str, int]) -> dict[str, float]:
    """GB/s per size, over `reps[size]` transfers after one warm-up."""
    proc, address = start_receiver(transport)
    results = {}
    try:
        if transport == "raw":
            host, port = address[len("raw://") :].rsplit(":", 1)
            conn = socket.create_connection((host, int(port)))
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def send(payload: np.ndarray) -> None:
                conn.sendall(struct.pack(">Q", payload.nbytes))
                conn.sendall(memoryview(payload))
                conn.recv(1)
        else:
            from services.kvtransfer import Senders, TransferHeader

            senders = Senders()

            def send(payload: np.ndarray) -> None:
                senders.send(
                    address,
                    TransferHeader("bench", payload.nbytes, deadline_s=60),
                    lambda _: payload,
                    60,
                )

        for label, nbytes in SIZES.items():
            payload = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
            send(payload)  # warm-up: connection, buffers
            t0 = time.perf_counter()
            for _ in range(reps[label]):
                send(payload)
            results[label] = nbytes * reps[label] / (time.perf_counter() - t0) / 1e9
    finally:
        proc.stdin.close()
        proc.kill()
        proc.wait()
    return results


def run(reps_small: int = 40, reps_large: int = 4) -> dict[str, dict[str, float]]:
    reps = {"1 MiB": reps_small, "64 MiB": reps_large}
    return {transport: measure(transport, reps) for transport in TRANSPORTS}


def report(results: dict[str, dict[str, float]]) -> str:
    lines = [
        "KV transfer throughput (GB/s; ratio to the raw socket)",
        f"{'':10}" + "".join(f"{s:>20}" for s in SIZES),
    ]
    for transport, by_size in results.items():
        cells = "".join(
            f"{by_size[s]:>11.2f} ({by_size[s] / results['raw'][s]:.2f}x)" for s in SIZES
        )
        lines.append(f"{transport:10}{cells}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--receiver", choices=TRANSPORTS, help=argparse.SUPPRESS)
    ap.add_argument("--reps-small", type=int, default=40)
    ap.add_argument("--reps-large", type=int, default=4)
    args = ap.parse_args()
    if args.receiver:
        serve_receiver(args.receiver)
        return
    print(report(run(args.reps_small, args.reps_large)))


if __name__ == "__main__":
    main()
