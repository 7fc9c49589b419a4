"""A soak with faults: `make run` under mixed traffic while its processes are killed and paused
and clients misbehave. Reports the requests completed and failed (each failure with its status:
none may hang), the restarts, each process's RSS and open descriptors at the start and the end,
and the prefix hit ratio clients saw before and after each fault.

    .venv/bin/python bench/soak.py [--minutes 20] [--model tandem-demo] [--kv-store on|mooncake]
                                   [--topology colocated|disaggregated] [--draft-service]
                                   [--kv-cache-bytes N] [--clients 6] [--burst 2000]
                                   [--faults all|name,name,...]

Traffic, from --clients threads without pause: chat, Responses and Messages, streamed and unary,
tool calls, and long shared prefixes (a few agent-sized system prompts, sessions keyed by
`x-session-affinity`). Faults, spread evenly over the run, in turn, for each process the stack
has: SIGKILL and SIGSTOP of a worker (the prefill and the decode worker, disaggregated) and of
the KV store (a Mooncake store node; SIGKILL of the master), SIGKILL of the draft service, the
gateway and Envoy; then a client that drops its stream after the first chunk, and a burst of
--burst streams at once. RSS and descriptors are sampled at the start, halfway and the end.
Exit status 1 when a request hung (no answer within its deadline) or a fault was never
recovered from.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx
import psutil

from bench.gguf_memory import cpu_name
from deploy.processes import ROLE_COMMANDS, role_of
from engine.progress import Stage

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEADLINE_S = 120.0  # a request unanswered this long has hung
RECOVERY_S = 10.0  # a fault's window: requests that failed within it count as the fault's
WINDOW_S = 30.0  # the hit ratio before and after a fault: requests completed in this window
FAULTS = {
    "kill worker": ("worker", signal.SIGKILL),
    "pause worker": ("worker", signal.SIGSTOP),
    "kill prefill": ("prefill", signal.SIGKILL),
    "pause prefill": ("prefill", signal.SIGSTOP),
    "kill decode": ("decode", signal.SIGKILL),
    "pause decode": ("decode", signal.SIGSTOP),
    "kill kvcache": ("kvcache", signal.SIGKILL),
    "pause kvcache": ("kvcache", signal.SIGSTOP),
    "kill mooncake-node": ("mooncake-node", signal.SIGKILL),
    "pause mooncake-node": ("mooncake-node", signal.SIGSTOP),
    "kill mooncake-master": ("mooncake-master", signal.SIGKILL),
    "kill draft": ("draft", signal.SIGKILL),
    "kill gateway": ("gateway", signal.SIGKILL),
    "kill envoy": ("envoy", signal.SIGKILL),
    "disconnect": (None, None),
    "burst": (None, None),
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@dataclass
class Outcome:
    kind: str
    status: str  # "ok", an HTTP status, or the exception's name ("hung": past DEADLINE_S)
    started: float
    ended: float
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class Soak:
    base: str
    model: str
    outcomes: list[Outcome] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    prefixes: list[str] = field(default_factory=list)

    def __post_init__(self):
        rng = random.Random(0)
        words = "agent tool repository function returns file patch test search plan".split()
        for i in range(4):  # long system prompts that sessions share (the demo's context is 1k)
            self.prefixes.append(
                f"You are coding agent {i}. " + " ".join(rng.choice(words) for _ in range(180))
            )

    def record(self, outcome: Outcome) -> None:
        with self.lock:
            self.outcomes.append(outcome)

    def request(self, kind: str, rng: random.Random) -> None:
        """One request of `kind`, its outcome recorded."""
        path, body, headers = self.shape(kind, rng)
        started = time.monotonic()
        stream = body.get("stream", False)
        usage: dict = {}
        try:
            with httpx.Client(timeout=httpx.Timeout(DEADLINE_S, connect=10.0)) as client:
                if not stream:
                    reply = client.post(self.base + path, json=body, headers=headers)
                    status = "ok" if reply.status_code == 200 else str(reply.status_code)
                    usage = reply.json().get("usage") or {} if status == "ok" else {}
                else:
                    with client.stream("POST", self.base + path, json=body, headers=headers) as r:
                        status = "ok" if r.status_code == 200 else str(r.status_code)
                        for line in r.iter_lines():
                            usage = {**usage, **(_usage(line) or {})}
                            if kind == "disconnect" and line.startswith("data:"):
                                break  # the client walks away mid-stream
        except httpx.TimeoutException:
            status = "hung"
        except httpx.HTTPError as exc:
            status = type(exc).__name__
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
        cached = details.get("cached_tokens", usage.get("cache_read_input_tokens", 0)) or 0
        prompt = usage.get("prompt_tokens", usage.get("input_tokens", 0)) or 0
        if "cache_read_input_tokens" in usage:  # Messages: input_tokens leaves the cached out
            prompt += cached
        self.record(Outcome(kind, status, started, time.monotonic(), prompt, cached))

    def shape(self, kind: str, rng: random.Random) -> tuple[str, dict, dict]:
        question = f"Question {rng.randrange(10**6)}: what next?"
        session = rng.randrange(len(self.prefixes))
        system = self.prefixes[session] if kind.startswith("agent") else "Be brief."
        headers = {"x-session-affinity": f"s{session}"} if kind.startswith("agent") else {}
        stream = kind.endswith("stream") or kind == "disconnect"
        if kind.startswith("responses"):
            body = {"model": self.model, "instructions": system, "input": question}
            return "/v1/responses", {**body, "max_output_tokens": 16, "stream": stream}, headers
        if kind.startswith("messages"):
            body = {"model": self.model, "system": system, "max_tokens": 16, "stream": stream}
            return (
                "/v1/messages",
                {**body, "messages": [{"role": "user", "content": question}]},
                headers,
            )
        body = {
            "model": self.model,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ],
            "max_tokens": 16,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        if kind == "tools":
            body["tools"] = TOOLS
        return "/v1/chat/completions", body, headers


KINDS = (
    "chat",
    "chat stream",
    "responses",
    "responses stream",
    "messages",
    "messages stream",
    "tools",
    "agent chat stream",
    "agent responses",
    "agent messages stream",
)


def _usage(line: str) -> dict | None:
    if not line.startswith("data:") or line.strip() == "data: [DONE]":
        return None
    try:
        event = json.loads(line[5:])
    except ValueError:
        return None
    found = event.get("usage") or (event.get("response") or {}).get("usage")
    if found is None and isinstance(event.get("message"), dict):
        found = event["message"].get("usage")
    return found


def processes(run: subprocess.Popen) -> dict[str, list[psutil.Process]]:
    found: dict[str, list[psutil.Process]] = {role: [] for role in ROLE_COMMANDS}
    for proc in psutil.Process(run.pid).children(recursive=True):
        try:
            role = role_of(proc.cmdline())
        except psutil.Error:
            continue
        if role:
            found[role].append(proc)
    return found


def footprint(run: subprocess.Popen) -> dict[str, tuple[float, int]]:
    """Each role's RSS (MiB) and open descriptors, summed over its processes."""
    out = {}
    for role, procs in processes(run).items():
        rss, fds = 0.0, 0
        for proc in procs:
            try:
                rss += proc.memory_info().rss / 2**20
                fds += proc.num_fds()
            except psutil.Error:
                continue
        if procs:
            out[role] = (rss, fds)
    return out


def restarts(base: str) -> dict[str, float]:
    try:
        page = httpx.get(base + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    found = {}
    for line in page.splitlines():
        if line.startswith("tandem:process_restarts_total{"):
            role = line.split('role="', 1)[1].split('"', 1)[0]
            found[role] = float(line.rsplit(" ", 1)[1])
    return found


def start(env: dict[str, str]) -> tuple[subprocess.Popen, list[str]]:
    run = subprocess.Popen(
        ["make", "--no-print-directory", "--silent", "run"],
        cwd=REPO_ROOT,
        env={k: v for k, v in env.items() if k != "MAKEFLAGS"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in run.stdout:
            lines.append(line)
            if "tandem is ready" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 300
    while not ready.wait(0.5):
        if run.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("make run did not start:\n" + "".join(lines[-20:]))
    return run, lines


def inject(name: str, run: subprocess.Popen, soak: Soak, burst: int) -> str:
    """Does fault `name`; what it did, or why it could not."""
    role, sig = FAULTS[name]
    if name == "disconnect":
        for _ in range(4):
            soak.request("disconnect", random.Random())
        return "4 streams dropped after their first chunk"
    if name == "burst":
        rng = random.Random(1)
        with ThreadPoolExecutor(min(burst, 256)) as pool:
            for _ in range(burst):
                pool.submit(soak.request, "chat stream", rng)
        return f"{burst} streams at once"
    procs = processes(run)[role]
    if not procs:
        return "skipped: no such process in this stack"
    os.kill(procs[0].pid, sig)
    return f"{sig.name} to {role} pid {procs[0].pid}"


def hit_ratio(outcomes: list[Outcome], start: float, end: float) -> float | None:
    window = [
        o for o in outcomes if start <= o.ended < end and o.status == "ok" and o.prompt_tokens
    ]
    prompt = sum(o.prompt_tokens for o in window)
    return sum(o.cached_tokens for o in window) / prompt if prompt else None


def soak(
    minutes: float,
    env: dict[str, str],
    model: str,
    clients: int,
    burst: int,
    faults: list[str],
    say=None,
) -> dict:
    """Runs the soak on a `make run` of `env`; returns the report, also printed through `say`
    (by default on stdout, each fault's line above the soak's progress on stderr)."""
    port = env["PORT"]
    base = f"http://127.0.0.1:{port}"
    run, lines = start(env)
    state = Soak(base, model)
    stopping = threading.Event()

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while not stopping.is_set():
            state.request(rng.choice(KINDS), rng)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    try:
        for thread in threads:
            thread.start()
        time.sleep(min(20.0, minutes * 60 / (len(faults) + 2)))  # warm: prefixes cached
        before = half = footprint(run)
        began = time.monotonic()
        gap = minutes * 60 / (len(faults) + 1)
        events = []
        with Stage("soak", len(faults), "faults", quiet=say is not None) as progress:
            for i, name in enumerate(faults):
                progress.detail = f"next: {name}"
                time.sleep(max(0.0, began + (i + 1) * gap - time.monotonic()))
                if i == len(faults) // 2:
                    half = footprint(run)  # growth after this point is what would be unbounded
                at = time.monotonic()
                did = inject(name, run, state, burst)
                (say or progress.say)(f"{time.monotonic() - began:6.0f} s  {name}: {did}")
                events.append((name, did, at))
                progress.advance()
            progress.detail = "the last stretch"  # as long as the gaps between faults
            time.sleep(max(0.0, began + minutes * 60 - time.monotonic()))
            progress.detail = ""
        stopping.set()
        for thread in threads:
            thread.join(DEADLINE_S + 10)
        after = footprint(run)
        counts = restarts(base)
    finally:
        stopping.set()
        os.killpg(run.pid, signal.SIGINT)
        try:
            run.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
    outcomes = list(state.outcomes)
    report = {
        "completed": sum(o.status == "ok" for o in outcomes),
        "failed": dict(Counter(o.status for o in outcomes if o.status != "ok")),
        "hung": sum(o.status == "hung" for o in outcomes),
        "failed by kind": dict(
            Counter(f"{o.kind}: {o.status}" for o in outcomes if o.status != "ok")
        ),
        "restarts": counts,
        "footprint": {
            role: (before.get(role), half.get(role), after.get(role))
            for role in before | half | after
        },
        "faults": [],
        "restart_lines": [line.strip() for line in lines if "restarting it" in line],
    }
    for name, did, at in events:
        failed = [
            o.status for o in outcomes if at <= o.ended < at + RECOVERY_S and o.status != "ok"
        ]
        ok_after = [o.ended for o in outcomes if o.started >= at and o.status == "ok"]
        report["faults"].append(
            {
                "fault": name,
                "did": did,
                "failed within 10 s": dict(Counter(failed)),
                "first success after s": round(min(ok_after) - at, 1) if ok_after else None,
                "hit before": hit_ratio(outcomes, at - WINDOW_S, at),
                "hit after": hit_ratio(outcomes, at + RECOVERY_S, at + RECOVERY_S + WINDOW_S),
            }
        )
    print_report(report, say or print)
    return report


def print_report(report: dict, say) -> None:
    say(f"\ncompleted {report['completed']}; failed {report['failed'] or 0}; hung {report['hung']}")
    say(f"failed by kind: {report['failed by kind'] or 'none'}")
    say(f"restarts (the gateway's /metrics): {report['restarts'] or 'none'}")
    say("\nfault                 first ok after s  failed within 10 s        hit before  hit after")
    for f in report["faults"]:
        hit = [f"{h:.2f}" if h is not None else "-" for h in (f["hit before"], f["hit after"])]
        first = f["first success after s"]
        say(
            f"{f['fault']:<21} {first if first is not None else 'never':>16}  "
            f"{json.dumps(f['failed within 10 s']):<25} {hit[0]:>10} {hit[1]:>10}"
        )
    say("\nrole              RSS MiB start -> half -> end     descriptors start -> half -> end")
    for role, samples in report["footprint"].items():
        a, h, b = (sample or (0, 0) for sample in samples)
        say(
            f"{role:<17} {a[0]:8.0f} -> {h[0]:5.0f} -> {b[0]:<8.0f} "
            f"{a[1]:6d} -> {h[1]:4d} -> {b[1]}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--model", default="tandem-demo")
    parser.add_argument("--kv-store", choices=("on", "mooncake"), default="on")
    parser.add_argument("--topology", choices=("colocated", "disaggregated"), default="colocated")
    parser.add_argument(
        "--draft-service",
        action="store_true",
        help="speculation by the demo's draft model, run as the draft service",
    )
    parser.add_argument(
        "--kv-cache-bytes", help="each worker's KV pool (make run's KV_CACHE_BYTES)"
    )
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--burst", type=int, default=2000)
    parser.add_argument("--faults", default="all")
    parser.add_argument("--port", type=int, default=18480)
    args = parser.parse_args()
    roles = {"gateway", "envoy", None}  # None: a fault of clients'
    roles |= {"worker"} if args.topology == "colocated" else {"prefill", "decode"}
    roles |= {"kvcache"} if args.kv_store == "on" else {"mooncake-node", "mooncake-master"}
    roles |= {"draft"} if args.draft_service else set()
    faults = (
        [name for name, (role, _) in FAULTS.items() if role in roles]
        if args.faults == "all"
        else args.faults.split(",")
    )
    unknown = set(faults) - set(FAULTS)
    if unknown:
        parser.error(f"unknown faults {sorted(unknown)}; known: {list(FAULTS)}")
    settings = {"MODEL": args.model, "KV_STORE": args.kv_store, "TOPOLOGY": args.topology}
    if args.draft_service:
        settings |= {"SPECULATIVE": "draft", "DRAFT_SERVICE": "1"}
    if args.kv_cache_bytes:
        settings["KV_CACHE_BYTES"] = args.kv_cache_bytes
    env = {**os.environ, **settings, "PORT": str(args.port)}
    shown = " ".join(f"{k}={v}" for k, v in settings.items())
    print(f"{cpu_name()}, {os.cpu_count()} CPUs; {args.minutes:g} min, {shown}; faults: {faults}")
    report = soak(args.minutes, env, args.model, args.clients, args.burst, faults)
    return 0 if report["hung"] == 0 and recovered(report) else 1


def recovered(report: dict) -> bool:
    """Every fault was followed by a request, sent after it, that succeeded within RECOVERY_S."""
    firsts = [f["first success after s"] for f in report["faults"]]
    return all(first is not None and first <= RECOVERY_S for first in firsts)


if __name__ == "__main__":
    sys.exit(main())
