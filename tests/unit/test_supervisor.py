"""deploy/supervisor.py without processes: the back-off, the crash-loop count, and the
supervisor restarting fake members (a fake process is one whose `poll` says it exited)."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from deploy import supervisor
from deploy.processes import Member, ServiceFailed
from deploy.supervisor import RestartPolicy, Supervisor, exit_status


class FakeProc:
    pid = os.getpid()  # running, never paused

    def __init__(self):
        self.returncode = None

    def poll(self):
        return self.returncode

    def kill(self):
        self.returncode = -9


def test_back_off_doubles_to_its_cap_and_resets_after_a_stable_run():
    policy = RestartPolicy()
    assert [policy.next_delay() for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]
    policy.died(supervisor.STABLE_S)
    assert policy.next_delay() == 0.5


def test_five_deaths_at_start_in_a_row_are_a_crash_loop_and_a_stable_run_forgives_them():
    policy = RestartPolicy()
    for _ in range(4):
        policy.died(None)
    policy.died(1.0)  # ready, but died within STABLE_S: still dying at start
    assert policy.crash_looping
    policy.died(supervisor.STABLE_S + 1)
    assert not policy.crash_looping and policy.num_early_deaths == 0


def test_exit_status_names_the_signal():
    assert exit_status(-9) == "killed by SIGKILL"
    assert exit_status(1) == "exit code 1"


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(supervisor, "FIRST_DELAY_S", 0.01)
    monkeypatch.setattr(supervisor, "MAX_DELAY_S", 0.02)
    monkeypatch.setattr(supervisor, "TICK_S", 0.01)


def watch(sup: Supervisor, until, timeout_s: float = 5.0) -> str:
    """Runs `watch` on a thread until `until()` holds; returns what it returned."""
    interrupted, result = threading.Event(), []
    thread = threading.Thread(target=lambda: result.append(sup.watch(interrupted)))
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not until() and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.01)
    interrupted.set()
    thread.join(timeout=5)
    sup.stop()
    return result[0] if result else ""


def test_a_dead_member_is_started_again_published_and_counted(fast, tmp_path):
    news, published = [], []

    def start():
        news.append(FakeProc())
        return news[-1], f"127.0.0.1:{len(news)}"

    member = Member("worker", "127.0.0.1:0", FakeProc(), start)
    lines = []
    sup = Supervisor(
        [member],
        lambda m, old, addr: published.append((m.address, addr)),
        lambda: None,
        str(tmp_path / "restarts.json"),
        log=lines.append,
    )
    member.proc.kill()
    assert watch(sup, lambda: published) == ""
    assert published == [("127.0.0.1:1", "127.0.0.1:0")] and member.proc is news[0]
    assert lines == ["worker 127.0.0.1:0 killed by SIGKILL; restarting it (attempt 1)"]
    assert json.loads((tmp_path / "restarts.json").read_text()) == {"worker": 1}


def test_a_member_that_keeps_failing_to_start_gives_up_naming_its_last_error(fast, tmp_path):
    def start():
        raise ServiceFailed("kvcache failed to start: cannot listen on 127.0.0.1:5 (taken?)")

    member = Member("kvcache", "127.0.0.1:5", FakeProc(), start)
    sup = Supervisor(
        [member], lambda *_: None, lambda: None, str(tmp_path / "r.json"), log=lambda _: None
    )
    sup.watched[0].ready_at -= supervisor.STABLE_S  # it ran fine before it died
    member.proc.kill()
    gave_up = watch(sup, lambda: sup.gave_up)
    assert gave_up == (
        "kvcache 127.0.0.1:5 keeps dying at start (5 times in a row); last error: "
        "kvcache failed to start: cannot listen on 127.0.0.1:5 (taken?)"
    )
    assert json.loads((tmp_path / "r.json").read_text()) == {"kvcache": 5}


def test_a_member_that_dies_soon_after_each_start_gives_up(fast, tmp_path):
    def start():
        proc = FakeProc()
        proc.returncode = 0  # ready, then gone at once
        return proc, "127.0.0.1:9"

    member = Member("envoy", "127.0.0.1:9", FakeProc(), start)
    sup = Supervisor(
        [member], lambda *_: None, lambda: None, str(tmp_path / "r.json"), log=lambda _: None
    )
    member.proc.returncode = 0
    assert watch(sup, lambda: sup.gave_up) == (
        "envoy 127.0.0.1:9 keeps dying at start (5 times in a row); last error: exit code 0"
    )


def test_a_member_failing_its_probe_is_killed_and_restarted(fast, monkeypatch, tmp_path):
    monkeypatch.setattr(supervisor, "PROBE_INTERVAL_S", 0.0)
    published = []
    member = Member(
        "gateway", "127.0.0.1:7", FakeProc(), lambda: (FakeProc(), "127.0.0.1:7"), lambda _: False
    )
    lines = []
    sup = Supervisor(
        [member],
        lambda *_: published.append(1),
        lambda: None,
        str(tmp_path / "r.json"),
        log=lines.append,
    )
    watch(sup, lambda: published)
    assert published and "not answering its health probe" in lines[0]


def test_stopping_ends_a_restart_waiting_in_its_back_off(monkeypatch, tmp_path):
    monkeypatch.setattr(supervisor, "TICK_S", 0.01)
    monkeypatch.setattr(supervisor, "FIRST_DELAY_S", 60.0)
    started = []
    member = Member("envoy", "127.0.0.1:8", FakeProc(), lambda: started.append(1))
    sup = Supervisor([member], lambda *_: None, lambda: None, str(tmp_path / "r.json"), log=print)
    member.proc.kill()
    begun = time.monotonic()
    watch(sup, lambda: sup.watched[0].restarting)
    sup.restarts.shutdown(wait=True)  # the restart waiting its minute has returned
    assert not started and time.monotonic() - begun < 3
