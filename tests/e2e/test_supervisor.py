"""`make run` heals (deploy/supervisor.py): a process killed (SIGKILL) or paused (SIGSTOP) is
restarted, new requests succeed within 10 s, /metrics counts the restart; a process that keeps
dying at start stops the stack with one line. The demo model, in two stacks that hold every role
between them: colocated with the built-in KV store, and disaggregated with a Mooncake store and
the draft service."""

from __future__ import annotations

import os
import re
import signal
import socket
import time
import urllib.request

import openai
import psutil
import pytest

from deploy.processes import role_of
from tests.e2e.make_run import demo_with_store, keep_reading, start_make_run, stop

RECOVERY_S = 10.0


def served(env: dict[str, str], port: int):
    run = start_make_run(env)
    output = keep_reading(run)
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=30
    )
    yield run, port, client, output
    stop(run)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Colocated, with the built-in KV store."""
    yield from served(*demo_with_store(tmp_path_factory.mktemp("supervised") / "kvcache"))


@pytest.fixture(scope="module")
def disaggregated_stack(tmp_path_factory):
    """A prefill and a decode worker, a Mooncake master with two store nodes, and the draft
    service."""
    env, port = demo_with_store(tmp_path_factory.mktemp("supervised") / "mooncake")
    env.update(TOPOLOGY="disaggregated", KV_STORE="mooncake", KV_STORE_DISK_BYTES="0")
    env.update(SPECULATIVE="draft", DRAFT_SERVICE="1")
    yield from served(env, port)


def pid_of(run, role: str) -> int | None:
    for proc in psutil.Process(run.pid).children(recursive=True):
        try:
            if role_of(proc.cmdline()) == role:
                return proc.pid
        except psutil.Error:
            continue
    return None


def restarts(port: int, role: str) -> float:
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    found = re.search(rf'tandem:process_restarts_total{{role="{role}"}} (\S+)', page)
    return float(found.group(1)) if found else 0.0


def chat(client: openai.OpenAI, max_tokens: int = 4, **kwargs):
    return client.chat.completions.create(
        model="tandem-demo",
        messages=[{"role": "user", "content": "Hello!"}],
        max_tokens=max_tokens,
        **kwargs,
    )


def until_served(client: openai.OpenAI, since: float) -> float:
    """Seconds from `since` to the first chat that succeeds; fails past RECOVERY_S."""
    while True:
        try:
            chat(client)
            return time.monotonic() - since
        except openai.APIError as exc:
            assert time.monotonic() - since < RECOVERY_S, f"not served again: {exc}"
            time.sleep(0.2)


def assert_back(run, port: int, role: str, old_pid: int, num_restarts: float, since: float):
    while (pid_of(run, role) or old_pid) == old_pid or restarts(port, role) <= num_restarts:
        assert time.monotonic() - since < RECOVERY_S, f"{role} not back"
        time.sleep(0.2)


@pytest.mark.parametrize(
    "stack_name, role",
    [
        *(("stack", role) for role in ("worker", "gateway", "envoy", "kvcache")),
        *(
            ("disaggregated_stack", role)
            for role in ("prefill", "decode", "draft", "mooncake-master", "mooncake-node")
        ),
    ],
)
def test_a_killed_process_is_restarted_and_the_service_answers_within_10s(
    request, stack_name, role
):
    run, port, client, output = request.getfixturevalue(stack_name)
    chat(client)
    before, old_pid = restarts(port, role), pid_of(run, role)
    os.kill(old_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    assert until_served(client, killed_at) < RECOVERY_S
    assert_back(run, port, role, old_pid, before, killed_at)
    assert any(f"make run: {role} " in line and "killed by SIGKILL" in line for line in output)


@pytest.mark.parametrize(
    "stack_name, role",
    [
        ("stack", "kvcache"),
        ("disaggregated_stack", "mooncake-node"),
        ("disaggregated_stack", "prefill"),
    ],
)
def test_a_paused_process_is_replaced_and_the_service_answers_within_10s(request, stack_name, role):
    run, port, client, output = request.getfixturevalue(stack_name)
    chat(client)
    before, old_pid = restarts(port, role), pid_of(run, role)
    os.kill(old_pid, signal.SIGSTOP)
    paused_at = time.monotonic()
    assert until_served(client, paused_at) < RECOVERY_S
    assert_back(run, port, role, old_pid, before, paused_at)
    assert any(f"make run: {role} " in line and "paused (SIGSTOP)" in line for line in output)


@pytest.mark.parametrize(
    "stack_name, role", [("stack", "worker"), ("disaggregated_stack", "decode")]
)
def test_a_paused_worker_is_replaced_and_its_stream_ends_with_an_error(request, stack_name, role):
    run, port, client, output = request.getfixturevalue(stack_name)
    before, old_pid = restarts(port, role), pid_of(run, role)
    stream = chat(client, max_tokens=1000, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    os.kill(old_pid, signal.SIGSTOP)
    paused_at = time.monotonic()
    with pytest.raises(openai.APIError):  # not a hang, not a reply cut short in silence
        for _ in stream:
            pass
    assert time.monotonic() - paused_at < RECOVERY_S
    assert until_served(client, paused_at) < RECOVERY_S
    assert_back(run, port, role, old_pid, before, paused_at)
    assert any(f"make run: {role} " in line and "paused (SIGSTOP)" in line for line in output)


def test_a_process_dying_at_start_five_times_stops_the_stack_naming_it(tmp_path):
    env, _ = demo_with_store(tmp_path / "kvcache")
    run = start_make_run(env)
    output = keep_reading(run)
    worker = psutil.Process(pid_of(run, "worker")).cmdline()
    store = worker[worker.index("--kv-store") + 1]
    host, store_port = store.rsplit(":", 1)
    os.kill(pid_of(run, "kvcache"), signal.SIGKILL)
    # Its port taken by another program: the store cannot come back where the workers look.
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    deadline = time.monotonic() + 2
    while True:
        try:
            squatter.bind((host, int(store_port)))
            break
        except OSError:  # the killed store's socket, for a moment
            assert time.monotonic() < deadline
            time.sleep(0.01)
    squatter.listen()
    children = psutil.Process(run.pid).children(recursive=True)
    try:
        assert run.wait(timeout=90) != 0
    finally:
        squatter.close()
    time.sleep(0.5)  # the reader takes the last lines
    gave_up = [line for line in output if "keeps dying at start" in line]
    assert gave_up == [
        f"make run: kvcache {store} keeps dying at start (5 times in a row); last error: "
        f"kvcache failed to start: cannot listen on {store} (is the port already taken?); "
        "stopping\n"
    ]
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive
