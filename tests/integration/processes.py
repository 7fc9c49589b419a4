"""Start tandem's services as real processes for a test, and read the address they bind."""

from __future__ import annotations

import subprocess
import sys
import time

STARTUP_TIMEOUT_S = 60


def start_service(module: str, *args: str) -> tuple[subprocess.Popen, str]:
    """Runs `python -m module args...`; returns the process and the host:port of its ready
    line (`... ready on HOST:PORT [name=HOST:PORT ...]`; see `named_address` for the rest)."""
    proc = subprocess.Popen([sys.executable, "-m", module, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if " ready on " in line:
            proc.ready_line = line
            return proc, line.split(" ready on ")[1].split()[0]
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError(f"{module} did not start")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


def named_address(proc: subprocess.Popen, name: str) -> str:
    """The `name=HOST:PORT` address from a service's ready line."""
    return next(w.split("=", 1)[1] for w in proc.ready_line.split() if w.startswith(name + "="))
