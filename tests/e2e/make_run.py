"""`make run` as a user starts it: in its own process group, so that Ctrl-C reaches every process
of the stack as it does on a terminal."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import psutil

from deploy.processes import REPO_ROOT, free_port


def demo_with_store(folder, disk_bytes: int = 0) -> tuple[dict[str, str], int]:
    """`make run`'s environment for the demo model with the KV store on (64 MiB of DRAM,
    `disk_bytes` of disk under `folder`) on a free port, and that port."""
    port = free_port()
    env = {
        **os.environ,
        "MODEL": "tandem-demo",
        "PORT": str(port),
        "KV_STORE": "on",
        "KV_STORE_DRAM_BYTES": str(64 << 20),
        "KV_STORE_DISK_BYTES": str(disk_bytes),
        "KV_STORE_DIR": str(folder),
    }
    return env, port


def make_run(env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        ["make", "--no-print-directory", "--silent", "run"],
        cwd=REPO_ROOT,
        env={k: v for k, v in env.items() if k != "MAKEFLAGS"},  # not pytest's make's
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def start_make_run(env: dict[str, str], timeout: float = 300) -> subprocess.Popen:
    """`make run`, returned once it prints that it is ready."""
    run = make_run(env)
    deadline, lines = time.monotonic() + timeout, []
    while not any("tandem is ready" in line for line in lines):
        assert time.monotonic() < deadline and run.poll() is None, "".join(lines)
        lines.append(run.stdout.readline())
    return run


def stop(run: subprocess.Popen) -> None:
    """Ctrl-C: every process of the stack exits (make itself reports the interrupt)."""
    processes = psutil.Process(run.pid).children(recursive=True)
    os.killpg(run.pid, signal.SIGINT)
    run.wait(timeout=60)
    _, alive = psutil.wait_procs(processes, timeout=30)
    assert not alive


def keep_reading(run: subprocess.Popen) -> list[str]:
    """The rest of `make run`'s output, read on a thread into the list returned (a pipe nobody
    reads fills, and then the services writing their logs to it block)."""
    lines: list[str] = []

    def read() -> None:
        for line in run.stdout:
            lines.append(line)

    threading.Thread(target=read, daemon=True).start()
    return lines
