"""Keeps `make run`'s processes serving: one that exits, or stops answering, is started again.

- **Restart.** A process that exits while the stack is not stopping is started again by its
  member's recipe (deploy/stack.py: the KV store, the draft service, the Mooncake master, the
  gateway and Envoy on the address their peers were given; a worker on a new one, which the
  workers file publishes). It waits a back-off first, FIRST_DELAY_S doubling to MAX_DELAY_S,
  reset once a process has run STABLE_S. One stderr line says what died, how, and the attempt.
- **Liveness.** A process seen paused (SIGSTOP) on two ticks in a row, or whose probe
  (deploy/probes.py) fails MAX_FAILED_PROBES times in a row, is SIGKILLed and so restarted: a
  paused worker's streams then end with UNAVAILABLE instead of hanging, and its replacement
  serves. The probe's threshold is loose (~10 s) so a busy process is never taken for a hung one.
- **Crash loop.** A process that dies at start (before its ready line, or within STABLE_S of
  it) MAX_EARLY_DEATHS times in a row makes the supervisor give up: `watch` returns one line
  naming it and its last error, and the caller stops the stack (as Kubernetes' CrashLoopBackOff
  would, except that it keeps trying).
- **Counted.** Restarts by role go to `restarts_file` (JSON), which the gateway's /metrics
  reads on every scrape (`tandem:process_restarts_total`): the counts survive a gateway restart.

Stopping (`stop`, from Ctrl-C) is at once, also while a restart waits or a process is starting:
restarts wait on the stopping event, and a process ready after it is killed (the launcher kills
one still starting).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from deploy.probes import is_paused
from deploy.processes import Member

FIRST_DELAY_S = 0.5
MAX_DELAY_S = 8.0
STABLE_S = 10.0
MAX_EARLY_DEATHS = 5
TICK_S = 0.5
PROBE_INTERVAL_S = 2.0
MAX_FAILED_PROBES = 5
PAUSED_TICKS = 2


@dataclass
class RestartPolicy:
    """One member's back-off and crash-loop count; no processes, no clock of its own."""

    num_restarts: int = 0  # since it last ran STABLE_S: the back-off's exponent
    num_early_deaths: int = 0  # deaths at start in a row

    def died(self, ran_s: float | None) -> None:
        """`ran_s`: seconds it served before it died; None: it never got ready."""
        if ran_s is not None and ran_s >= STABLE_S:
            self.num_restarts = self.num_early_deaths = 0
        else:
            self.num_early_deaths += 1

    @property
    def crash_looping(self) -> bool:
        return self.num_early_deaths >= MAX_EARLY_DEATHS

    def next_delay(self) -> float:
        """The wait before the next start; each call counts one restart."""
        delay = min(FIRST_DELAY_S * 2**self.num_restarts, MAX_DELAY_S)
        self.num_restarts += 1
        return delay


def exit_status(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


@dataclass(eq=False)
class _Watched:
    member: Member
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    ready_at: float = field(default_factory=time.monotonic)
    restarting: bool = False
    killed_because: str = ""  # the supervisor killed it: why (said instead of the signal)
    num_failed_probes: int = 0
    num_paused_ticks: int = 0
    probe: Future | None = None
    probed_at: float = 0.0


class Supervisor:
    """Watches `members`; `restarted(member, old_proc, old_address)` is called (under the
    supervisor's lock, not while stopping) once a member's new process is ready, so the stack
    can publish it; `stop_all()` stops the stack."""

    def __init__(self, members, restarted, stop_all, restarts_file: str, log=None):
        self.watched = [_Watched(m) for m in members]
        self.restarted, self.stop_all = restarted, stop_all
        self.restarts_file = restarts_file
        self.log = log or (lambda line: print(f"make run: {line}", file=sys.stderr, flush=True))
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.gave_up = ""
        self.num_restarts: Counter = Counter()
        self.probes = ThreadPoolExecutor(max_workers=4, thread_name_prefix="probe")
        # Threads that live as long as the stack: a child can be tied to the thread that
        # started it (Envoy gets SIGTERM when that thread ends: PR_SET_PDEATHSIG).
        self.restarts = ThreadPoolExecutor(len(self.watched), thread_name_prefix="restart")
        self._write_counts()

    def watch(self, interrupted: threading.Event) -> str:
        """Until `interrupted` is set (returns "") or a member crash-loops (returns the line)."""
        while not interrupted.wait(TICK_S) and not self.gave_up:
            for watched in self.watched:
                if not watched.restarting:
                    self._check(watched)
        return self.gave_up

    def stop(self) -> None:
        with self.lock:
            self.stopping.set()
        self.probes.shutdown(wait=False, cancel_futures=True)
        self.restarts.shutdown(wait=False, cancel_futures=True)
        self.stop_all()

    def _check(self, watched: _Watched) -> None:
        member = watched.member
        returncode = member.proc.poll()
        if returncode is not None:
            cause = watched.killed_because or exit_status(returncode)
            watched.policy.died(time.monotonic() - watched.ready_at)
            watched.killed_because = ""
            if watched.policy.crash_looping:
                self._give_up(watched, cause)
            else:
                watched.restarting = True
                self.restarts.submit(self._restart, watched, cause)
            return
        watched.num_paused_ticks = watched.num_paused_ticks + 1 if is_paused(member.proc.pid) else 0
        if watched.num_paused_ticks >= PAUSED_TICKS:
            self._kill(watched, "paused (SIGSTOP); killed")
        elif member.probe is not None:
            self._probe(watched)

    def _probe(self, watched: _Watched) -> None:
        if watched.probe is not None and watched.probe.done():
            answered = watched.probe.result()
            watched.num_failed_probes = 0 if answered else watched.num_failed_probes + 1
            watched.probe = None
            if watched.num_failed_probes >= MAX_FAILED_PROBES:
                self._kill(
                    watched, f"not answering its health probe {MAX_FAILED_PROBES} times; killed"
                )
                return
        if watched.probe is None and time.monotonic() - watched.probed_at >= PROBE_INTERVAL_S:
            watched.probed_at = time.monotonic()
            watched.probe = self.probes.submit(watched.member.probe, watched.member.address)

    def _kill(self, watched: _Watched, why: str) -> None:
        watched.killed_because = why
        watched.num_failed_probes = watched.num_paused_ticks = 0
        watched.probe = None
        watched.member.proc.kill()

    def _restart(self, watched: _Watched, cause: str) -> None:
        """Starts the member again after its back-off until it is ready, it crash-loops, or
        the stack stops. Runs on the restart pool."""
        member, policy = watched.member, watched.policy
        self.log(
            f"{member.role} {member.address} {cause}; restarting it (attempt {policy.num_restarts + 1})"
        )
        while not self.stopping.wait(policy.next_delay()):
            self._count(member.role)
            try:
                proc, address = member.start()
            except Exception as exc:  # any failure to start is one (ServiceFailed says its cause)
                if self.stopping.is_set():  # killed by `stop` while it started
                    return
                cause = str(exc)
                policy.died(None)
                if policy.crash_looping:
                    self._give_up(watched, cause)
                    return
                self.log(
                    f"{member.role} {member.address} failed to start again: {cause} "
                    f"(attempt {policy.num_restarts + 1} next)"
                )
                continue
            with self.lock:
                if self.stopping.is_set():
                    proc.kill()
                    return
                old_proc, old_address = member.proc, member.address
                member.proc, member.address = proc, address
                watched.ready_at, watched.probed_at, watched.probe = time.monotonic(), 0.0, None
                watched.num_failed_probes = watched.num_paused_ticks = 0
                self.restarted(member, old_proc, old_address)
                watched.restarting = False
            return

    def _give_up(self, watched: _Watched, cause: str) -> None:
        self.gave_up = (
            f"{watched.member.role} {watched.member.address} keeps dying at start "
            f"({watched.policy.num_early_deaths} times in a row); last error: {cause}"
        )

    def _count(self, role: str) -> None:
        with self.lock:
            self.num_restarts[role] += 1
            self._write_counts()

    def _write_counts(self) -> None:
        partial = self.restarts_file + ".partial"
        with open(partial, "w") as f:
            json.dump(dict(self.num_restarts), f)
        os.replace(partial, self.restarts_file)
