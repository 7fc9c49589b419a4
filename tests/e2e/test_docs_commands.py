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

import http.client
import os
import subprocess
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from docs.tools import blocks
from tests.e2e.make_run import demo_with_store, keep_reading, start_make_run, stop

DOCS_MODEL, DOCS_PORT = "SmolLM2-135M-Instruct.Q4_1", "127.0.0.1:8080"
BLOCK_TIMEOUT_S = 120
# curl as a reader's script wants it: an HTTP error is a failure, with its body printed.
SHELL_PRELUDE = 'curl() { command curl -sS --fail-with-body --max-time 60 "$@"; }\n'
RUN = [b for b in blocks.all_blocks() if b.mark in ("runnable", "skip")]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    env, port = demo_with_store(tmp_path_factory.mktemp("kvcache"), disk_bytes=64 << 20)
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
        except (OSError, ValueError, http.client.HTTPException):
            return None
        return text if "# TYPE" in text else None

    with ThreadPoolExecutor(len(ports)) as pool:
        return [p for p in pool.map(page, sorted(ports)) if p]


# Metrics a panel names that this stack declares on /metrics but has no sample of after the
# docs' traffic, each with why: a setup or an event this stack does not have.
NO_SAMPLES_HERE = {
    "tandem:request_errors_total": "a request that ends in an error after admission",
    "tandem:api_key_rejected_total": "API keys on (API_KEYS_FILE)",
    "tandem:api_key_tokens_total": "API keys on (API_KEYS_FILE)",
    "tandem:kv_transfer_bytes_total": "disaggregated workers (TOPOLOGY=disaggregated)",
    "tandem:kv_transfer_seconds_bucket": "disaggregated workers (TOPOLOGY=disaggregated)",
    "tandem:kv_store_failures_total": "a KV store call that fails",
    "tandem:kv_store_writes_dropped_total": "a write-through shed or backed off",
    "tandem:process_restarts_total": "a process restarted by the supervisor",
}


def exported(pages: list[str]) -> tuple[set[str], set[str]]:
    """(names with a sample, names declared) on the pages; a histogram declares its series."""
    sampled, declared = set(), set()
    for page in pages:
        for line in page.splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split(" ", 3)
                suffixes = ("_bucket", "_count", "_sum") if kind == "histogram" else ("",)
                declared |= {name + s for s in suffixes}
            elif line and not line.startswith("#"):
                sampled.add(line.split("{")[0].split(" ")[0])
    return sampled, declared | sampled


def test_every_dashboard_metric_is_on_the_stacks_metrics(stack):
    from tests.unit.test_grafana_dashboards import dashboard_metrics

    run, port, _ = stack
    # a refusal, so the refused-requests series has a sample whichever blocks ran before
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=b'{"model": "tandem-demo", "messages": [], "logit_bias": {"1": 5}}',
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(request, timeout=30)
    sampled, declared = exported(metrics_pages(run))
    used = dashboard_metrics()
    unknown = {m: sorted(panels) for m, panels in used.items() if m not in declared}
    assert not unknown, f"dashboard metrics no process of the stack exports: {unknown}"
    quiet = {m for m in used if m not in sampled}
    unexplained = quiet - set(NO_SAMPLES_HERE)
    assert not unexplained, f"declared but never sampled here, and not listed: {unexplained}"
    stale = set(NO_SAMPLES_HERE) - quiet
    assert not stale, f"listed as sampled only elsewhere, but sampled here: {stale}"
