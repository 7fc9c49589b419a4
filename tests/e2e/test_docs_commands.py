"""The docs' commands against one `make run` (the demo model, with the KV store on), as a reader
runs them: every block marked runnable (docs/tools/blocks.py) is run and fails the suite when it
fails; a block marked skip is shown skipped with its reason. Blocks name the default model and
port, which are swapped for the demo model's name and this stack's port (the demo model starts
in a second and answers the same questions). Shell blocks run in bash with -euo pipefail and
curl failing on an HTTP error (--fail-with-body), in a scratch folder with the virtualenv first on
PATH; Python blocks run in the virtualenv's interpreter.

The same stack then serves the Grafana dashboards' check: every metric a panel of
deploy/grafana/ names is one the stack's processes export on /metrics."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from deploy.processes import free_port
from docs.tools import blocks
from tests.e2e.make_run import keep_reading, start_make_run, stop

DOCS_MODEL, DOCS_PORT = "SmolLM2-135M-Instruct.Q4_1", "127.0.0.1:8080"
BLOCK_TIMEOUT_S = 120
# curl as a reader's script wants it: an HTTP error is a failure, with its body printed.
SHELL_PRELUDE = 'curl() { command curl -sS --fail-with-body --max-time 60 "$@"; }\n'
RUN = [b for b in blocks.all_blocks() if b.mark in ("runnable", "skip")]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    port = free_port()
    env = {
        **os.environ,
        "MODEL": "tandem-demo",
        "PORT": str(port),
        "KV_STORE": "on",
        "KV_STORE_DRAM_BYTES": str(64 << 20),
        "KV_STORE_DISK_BYTES": str(64 << 20),
        "KV_STORE_DIR": str(tmp_path_factory.mktemp("kvcache")),
    }
    run = start_make_run(env)
    output = keep_reading(run)
    yield run, port, output
    stop(run)


def run_block(block: blocks.Block, port: int, cwd) -> subprocess.CompletedProcess:
    code = block.code.replace(DOCS_PORT, f"127.0.0.1:{port}").replace(DOCS_MODEL, "tandem-demo")
    venv_bin = os.path.dirname(sys.executable)
    env = {**os.environ, "PATH": f"{venv_bin}:{os.environ['PATH']}"}
    if block.language == "python":
        command = [sys.executable, "-c", code]
    else:
        command = ["bash", "-euo", "pipefail", "-c", SHELL_PRELUDE + code]
    return subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S
    )


@pytest.mark.parametrize("block", RUN, ids=[b.name for b in RUN])
def test_docs_block_runs(stack, block, tmp_path):
    if block.mark == "skip":
        pytest.skip(f"{block.name}: {block.reason}")
    _, port, _ = stack
    done = run_block(block, port, tmp_path)
    assert done.returncode == 0, (
        f"{block.name} failed (exit {done.returncode}):\n{block.code}\n"
        f"stdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-2000:]}"
    )


def metrics_pages(run) -> list[str]:
    """/metrics of every process of the stack: each listening port of each that answers it."""
    ports = {
        conn.laddr.port
        for proc in [psutil.Process(run.pid), *psutil.Process(run.pid).children(recursive=True)]
        for conn in proc.net_connections(kind="tcp")
        if conn.status == psutil.CONN_LISTEN
    }

    def page(port: int) -> str | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as reply:
                text = reply.read().decode()
        except (OSError, ValueError, urllib.error.HTTPError):
            return None
        return text if "# TYPE" in text else None

    with ThreadPoolExecutor(len(ports)) as pool:
        return [p for p in pool.map(page, sorted(ports)) if p]
