"""Long prompts on a GGUF model, in one run against llama.cpp's server on the same file: the
time to the first token of a cold prompt at each length (tandem's engine in process, whole and
chunked; llama-server over HTTP with its prompt cache off), and of a prompt that extends a cached
prefix by --extend tokens against the same prompt cold.

Every prompt is seeded random token ids (no two share a first block, so nothing is cached unless
meant); each TTFT is the wall time of a 1-token completion. llama-server's figure includes its
HTTP round trip on loopback (about a millisecond), tandem's none.

    .venv/bin/python bench/long_prompt.py [--model smollm2] [--lengths 2000,4000,8000]
        [--chunk 512] [--extend 500] [--no-llamacpp]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
import urllib.request

from bench.gguf_memory import cpu_name
from bench.serving import LLAMACPP_SERVER, LlamaCppServer, gguf_file
from engine.progress import Stage

KV_CACHE_BYTES = 1 << 30  # SmolLM2's 8k context in fp32 is 0.38 GB


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


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


def make_engine(folder: str, batched_tokens: int, wave_tokens: int, max_len: int):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(
        EngineConfig(
            model=folder,
            kv_cache_bytes=KV_CACHE_BYTES,
            max_model_len=max_len,
            max_num_batched_tokens=batched_tokens,
            wave_batched_tokens=wave_tokens,
        )
    )
    engine.generate([list(range(100, 164))], SamplingParams(max_tokens=2, temperature=0))  # warm
    return engine


class LlamaCpp:
    def __init__(self, gguf: str, max_len: int):
        from bench.serving import wait_ready

        self.server = LlamaCppServer(gguf, "model", max_len, num_slots=1)
        self.url = self.server.start()
        wait_ready(self.url, "model", self.server.proc, 120)

    def ttft(self, ids: list[int], cache: bool = False) -> float:
        body = {"prompt": ids, "n_predict": 1, "cache_prompt": cache, "temperature": 0}
        request = urllib.request.Request(
            self.url + "/completion",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        start = time.perf_counter()
        with urllib.request.urlopen(request, timeout=3600) as reply:
            json.load(reply)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--lengths", default="2000,4000,8000")
    parser.add_argument(
        "--chunk", type=int, default=512, help="tokens a chunked prefill step takes"
    )
    parser.add_argument("--extend", type=int, default=500)
    parser.add_argument("--no-llamacpp", action="store_true")
    args = parser.parse_args()
    from engine.gguf.folder import model_folder

    folder = model_folder(args.model)
    lengths = [int(n) for n in args.lengths.split(",")]
    longest = max(lengths)
    max_len = longest + 16
    rng = random.Random(0)
    prompts = {n: prompt(rng, n) for n in lengths}
    base = prompt(rng, longest - args.extend)
    extended = base + prompt(rng, args.extend)
    commit = os.popen("git rev-parse --short HEAD").read().strip()
    print(
        f"{cpu_name()}, {os.cpu_count()} CPUs; commit {commit}; {os.path.basename(gguf_file(folder))}"
    )

    with Stage("tandem, long prompts", len(lengths) + 5, "prompts") as progress:
        ttft = progress.counted(tandem_ttft)
        whole = make_engine(folder, max_len, 0, max_len)
        ours = {n: ttft(whole, prompts[n])[0] for n in lengths}
        ttft(whole, base)  # the prefix, cached
        cached_ttft, generated, cached = ttft(whole, extended, max_tokens=8)
        cold_extended = ttft(whole, prompt(rng, len(extended)))[0]
        del whole
        chunked = {}
        for label, batched, wave in (
            (f"chunks of {args.chunk}", args.chunk, 0),
            (f"default ({args.chunk}, waves of 2048)", args.chunk, 2048),
        ):
            engine = make_engine(folder, batched, wave, max_len)
            chunked[label] = ttft(engine, prompt(rng, longest))[0]
            del engine

    theirs = {}
    if not args.no_llamacpp and os.path.exists(LLAMACPP_SERVER):
        peer = LlamaCpp(gguf_file(folder), max_len)
        try:
            with Stage("llama.cpp, long prompts", len(lengths) + 3, "prompts") as progress:
                ttft = progress.counted(peer.ttft)
                ttft(list(range(100, 164)))  # warm
                theirs = {n: ttft(prompts[n]) for n in lengths}
                ttft(base, cache=True)
                theirs["cached"] = ttft(extended, cache=True)
        finally:
            peer.server.stop()
    elif not args.no_llamacpp:
        print(f"llama-server not found at {LLAMACPP_SERVER} (make peers-llamacpp): tandem only")

    print("\ncold TTFT (s), whole prompt in one step")
    print(f"{'tokens':>8} {'tandem':>8} {'llama.cpp':>10} {'llama/tandem':>13}")
    for n in lengths:
        peer_s = theirs.get(n)
        ratio = f"{peer_s / ours[n]:.2f}x" if peer_s else "-"
        peer_text = f"{peer_s:.2f}" if peer_s else "-"
        print(f"{n:>8} {ours[n]:>8.2f} {peer_text:>10} {ratio:>13}")
    print(f"\nprefill of {longest} tokens: whole {ours[longest]:.2f} s")
    for label, seconds in chunked.items():
        print(f"  {label}: {seconds:.2f} s ({seconds / ours[longest]:.2f}x whole)")
    print(
        f"\n{len(base)} cached + {args.extend} new tokens: TTFT {cached_ttft:.3f} s, "
        f"{100 * cached_ttft / cold_extended:.1f}% of the same length cold ({cold_extended:.2f} s); "
        f"{cached} tokens found cached, {generated} generated"
    )
    if "cached" in theirs:
        print(f"  llama.cpp, its slot's prompt cache: {theirs['cached']:.3f} s")


if __name__ == "__main__":
    main()
