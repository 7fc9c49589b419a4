"""`make run`: the whole system on this machine. Workers, a gateway and Envoy, each its own
process; prints how to call it; Ctrl-C stops everything it started.

Environment: PORT (8080), MODEL (smollm2, the embedded SmolLM2-135M-Instruct GGUF file; tandem-demo,
the demo model; any Hugging Face folder the engine supports, served under the folder's name; or a
GGUF file, a split set's first file or a folder holding one, served under the file's name), HOST
(127.0.0.1), TOPOLOGY (colocated | disaggregated), WORKERS (colocated: 1), PREFILL and DECODE
(disaggregated: 1 each), KV_TRANSPORT (ucx | tcp | mooncake), PUBLIC_METRICS (1: the gateway's
/metrics on the public port, with API keys only for a key with the metrics scope; 0 closes that
path), ENVOY_MAX_CONNECTIONS (Envoy's cap on client connections; 16384), KV_CACHE_BYTES (each
worker's KV pool), DTYPE (auto | float32 | bfloat16 | float16: the weights', activations' and KV
cache's; auto: the checkpoint's, fp32 for a GGUF file), ROUTER (kv | load | round_robin),
TOOL_CALL_PARSER (the markup tool calls come in, vLLM's names: hermes, qwen3_coder, llama3_json,
mistral, deepseek_v3, deepseek_v31, kimi_k2, llama4_json, llama4_pythonic, openai (gpt-oss's
harmony); default: detected from the chat template and model_type),
REASONING_PARSER (deepseek_r1, qwen3, kimi_k2, openai_gptoss or none; detected alike),
TRUST_REMOTE_CODE (1: a tokenizer only the checkpoint's own Python reads, tokenizer_config.json's
auto_map with no tokenizer.json or tiktoken.model, is loaded through transformers, running that
code), PRICES (input:X,cached_input:Y,output:Z, USD per million tokens:
usage then carries cost), KV_STORE (on: a KV cache store for every worker, with KV_STORE_DRAM_BYTES,
KV_STORE_DISK_BYTES, KV_STORE_DIR; default off), SPECULATIVE (off | ngram | draft | eagle3:
speculative decoding's drafter; ngram), SPEC_TOKENS (the most draft tokens a request verifies a
step; 8, or peers' 3 for an EAGLE-3 head given as DRAFT_MODEL, such as a published one), DRAFT_MODEL
(draft: the draft model's folder, the demo's own for the demo model, which other models must be
given; eagle3: the head's, by default the one `make draft-model MODEL=...` builds beside the
model's folder), DRAFT_SERVICE (1: the drafter runs in a draft service the workers call, not
in each worker), API_KEYS_FILE (callers need a key from that file: services/gateway/api_keys.py),
TLS_CERT with TLS_KEY (PEM files: Envoy serves HTTPS and gRPC over TLS), TP (each worker's
tensor-parallel ranks, in either topology), PP (pipeline stages, likewise) and EP (1: with TP,
experts placed whole across the ranks).
A service that cannot start makes it print one line naming the cause and exit 1; a setting value
it does not know (deploy/run_settings.py) is refused with one line before anything starts (exit 2).
Once up, a process that exits, or is paused or stops answering, is restarted with back-off (one
line each on stderr, counted in /metrics); one that dies at start five times in a row stops the
stack with one line naming it and its last error, exit 1 (deploy/supervisor.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading

import psutil

from deploy.envoy.render import MAX_CONNECTIONS
from deploy.processes import ServiceFailed
from deploy.run_settings import refusal
from deploy.stack import start_stack
from deploy.supervisor import Supervisor
from engine.errors import CheckpointError
from engine.gguf.folder import DEFAULT_MODEL, EMBEDDED, head_folder, model_folder

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def banner(
    host: str, port: int, model: str, layout: str, keyed: bool = False, tls: bool = False
) -> str:
    url = f"{'https' if tls else 'http'}://{host}:{port}"
    auth = ' -H "Authorization: Bearer $TANDEM_API_KEY"' if keyed else ""
    key = 'os.environ["TANDEM_API_KEY"]' if keyed else '"none"'
    keys = (
        (
            "\n  API keys are on: export TANDEM_API_KEY=<a key of API_KEYS_FILE> (make one with\n"
            "  python -m services.gateway.api_keys FILE NAME)\n"
        )
        if keyed
        else ""
    )
    return f"""
tandem is ready on {url}  (model: {model}; {layout})
{keys}
  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

  python -c 'import os; from openai import OpenAI
  c = OpenAI(base_url="{url}/v1", api_key={key})
  r = c.chat.completions.create(model="{model}", messages=[{{"role": "user", "content": "Hello!"}}])
  print(r.choices[0].message.content)'

  gRPC: tandem.v1.Inference at {host}:{port} (protos/tandem/v1/inference.proto)
  REST: POST {url}/tandem/v1/chat/completions (and :stream for server-sent events)
  Agents: OpenAI Responses at {url}/v1/responses, Anthropic Messages at {url}/v1/messages

Ctrl-C stops everything.
"""


def flags(names: dict[str, str]) -> tuple[str, ...]:
    """`--flag value` for each environment variable that is set."""
    return tuple(
        part
        for env, flag in names.items()
        if os.environ.get(env)
        for part in (flag, os.environ[env])
    )


def port_is_free(host: str, port: int) -> bool:
    """No live listener holds the port. SO_REUSEADDR, as Envoy binds: the sockets of a listener
    that just stopped (TIME_WAIT, up to a minute) do not count, a listening socket still does."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def drafter_folder(method: str, model: str, model_dir: str, is_demo: bool) -> tuple[str, str]:
    """SPECULATIVE=method's drafter (DRAFT_MODEL, else the model's own: the demo's draft model,
    or the EAGLE-3 head beside the model's folder that `make draft-model MODEL=...` builds),
    and a one-line refusal where there is none ('' otherwise)."""
    if method not in ("draft", "eagle3"):
        return "", ""
    given = os.environ.get("DRAFT_MODEL")
    if given:
        return given, ""
    if method == "eagle3" and os.path.isdir(head_folder(model_dir)):
        return head_folder(model_dir), ""
    if method == "draft" and is_demo:
        return os.path.join(REPO_ROOT, "demo", "tandem-demo-draft"), ""
    hint = (
        f"no EAGLE-3 head at {head_folder(model_dir)}: build it with `make draft-model "
        f"MODEL={model}`, or give DRAFT_MODEL"
        if method == "eagle3"
        else "give DRAFT_MODEL (the demo's draft model drafts for the demo model only)"
    )
    return "", f"make run: SPECULATIVE={method} needs a drafter for this model: {hint}"


def main() -> int:
    refused = refusal(os.environ)
    if refused:
        print(refused, file=sys.stderr)
        return 2
    host = os.environ.get("HOST") or "127.0.0.1"
    port = int(os.environ.get("PORT") or 8080)
    model = os.environ.get("MODEL") or DEFAULT_MODEL
    try:  # a name or a GGUF file: the folder every service reads, made once here
        model_dir = os.path.abspath(
            model_folder(model if model in EMBEDDED else os.path.abspath(model))
        )
    except CheckpointError as exc:  # it names the file where it is about one
        said = str(exc)
        print(
            f"make run: {said if os.path.abspath(model) in said else f'MODEL={model}: {said}'}",
            file=sys.stderr,
        )
        return 1
    is_demo = model_dir == os.path.abspath(model_folder("tandem-demo"))
    num_workers = int(os.environ.get("WORKERS") or 1)
    topology = os.environ.get("TOPOLOGY") or "colocated"
    num_prefill = int(os.environ.get("PREFILL") or 1)
    num_decode = int(os.environ.get("DECODE") or 1)
    # Speculative decoding: prompt lookup with up to 8 draft tokens measured best on the demo
    # model (bench/README.md); the workers' own default is off.
    method = os.environ.get("SPECULATIVE") or "ngram"
    default_tokens = "3" if method == "eagle3" and os.environ.get("DRAFT_MODEL") else "8"
    speculative = (
        "--speculative",
        method,
        "--num-speculative-tokens",
        os.environ.get("SPEC_TOKENS") or default_tokens,
    )
    draft_model, refused = drafter_folder(method, model, model_dir, is_demo)
    if refused:
        print(refused, file=sys.stderr)
        return 2
    draft_args = None
    if method in ("draft", "eagle3") and os.environ.get("DRAFT_SERVICE") == "1":
        speculative, draft_args = speculative[2:], ("--draft-model", draft_model)
    elif method in ("draft", "eagle3"):
        speculative += ("--draft-model", draft_model)
    # Settings passed through to the services' flags when given.
    worker_args = (
        flags(
            {
                "KV_TRANSPORT": "--kv-transport",
                "KV_CACHE_BYTES": "--kv-cache-bytes",
                "DTYPE": "--dtype",
                "TP": "--tensor-parallel-size",
                "PP": "--pipeline-parallel-size",
            }
        )
        + speculative
    )
    if os.environ.get("EP") == "1":
        worker_args += ("--enable-expert-parallel",)
    gateway_args = flags(
        {
            "PRICES": "--prices",
            "ROUTER": "--router",
            "API_KEYS_FILE": "--api-keys-file",
            "TOOL_CALL_PARSER": "--tool-call-parser",
            "REASONING_PARSER": "--reasoning-parser",
        }
    )
    if os.environ.get("TRUST_REMOTE_CODE") == "1":  # both read the tokenizer
        gateway_args += ("--trust-remote-code",)
        worker_args += ("--trust-remote-code",)
    tls = (os.environ["TLS_CERT"], os.environ["TLS_KEY"]) if os.environ.get("TLS_CERT") else None
    if bool(os.environ.get("TLS_CERT")) != bool(os.environ.get("TLS_KEY")):
        print("make run: TLS needs both TLS_CERT and TLS_KEY (PEM files)", file=sys.stderr)
        return 2
    kv_store_args = (
        flags(
            {
                "KV_STORE_DRAM_BYTES": "--dram-bytes",
                "KV_STORE_DISK_BYTES": "--disk-bytes",
                "KV_STORE_DIR": "--disk-dir",
            }
        )
        if os.environ.get("KV_STORE") == "on"
        else None
    )
    # KV_STORE=mooncake: a Mooncake Store pool of KV_STORE_NODES nodes, each of
    # KV_STORE_DRAM_BYTES and a disk tier of KV_STORE_DISK_BYTES (0: none) under KV_STORE_DIR.
    mooncake = (
        (
            int(os.environ.get("KV_STORE_NODES") or 2),
            int(os.environ.get("KV_STORE_DRAM_BYTES") or 256 << 20),
            int(os.environ.get("KV_STORE_REPLICAS") or 1),
        )
        if os.environ.get("KV_STORE") == "mooncake"
        else None
    )
    if not os.path.isdir(model_dir):
        print(f"make run: MODEL={model_dir} is not a directory", file=sys.stderr)
        return 2
    if not port_is_free(host, port):
        print(
            f"make run: port {port} on {host} is already taken; pick another with PORT=",
            file=sys.stderr,
        )
        return 1
    name = os.path.basename(os.path.normpath(model_dir))
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    try:
        stack = start_stack(
            model_dir,
            port,
            num_workers,
            host,
            worker_args=worker_args,
            stderr=None,
            progress=lambda m: print(m, flush=True),
            topology=topology,
            num_prefill=num_prefill,
            num_decode=num_decode,
            gateway_args=gateway_args,
            kv_store_args=kv_store_args,
            mooncake=mooncake,
            mooncake_disk_bytes=int(os.environ.get("KV_STORE_DISK_BYTES") or 4 << 30),
            mooncake_disk_dir=os.environ.get("KV_STORE_DIR", ""),
            draft_args=draft_args,
            tls=tls,
            public_metrics=os.environ.get("PUBLIC_METRICS", "1") != "0",
            envoy_max_connections=int(os.environ.get("ENVOY_MAX_CONNECTIONS") or MAX_CONNECTIONS),
        )
    except (ServiceFailed, RuntimeError, ValueError, FileNotFoundError) as exc:
        print(f"make run: {exc}", file=sys.stderr)
        return 1
    supervisor = Supervisor(stack.members, stack.restarted, stack.stop, stack.restarts_file)
    try:
        layout = ", ".join(f"{len(a)} {role}" for role, a in stack.workers.items() if a)
        print(
            banner(
                host,
                port,
                name,
                f"{topology}: {layout}".replace("both", "colocated"),
                keyed=bool(os.environ.get("API_KEYS_FILE")),
                tls=tls is not None,
            ),
            flush=True,
        )
        gave_up = supervisor.watch(stopping)
        if gave_up:
            print(f"make run: {gave_up}; stopping", file=sys.stderr, flush=True)
            return 1
        return 0
    finally:
        supervisor.stop()
        for child in psutil.Process().children():  # one a restart was still starting
            with contextlib.suppress(psutil.Error):
                child.kill()


if __name__ == "__main__":
    sys.exit(main())
