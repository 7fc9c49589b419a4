"""The invariance contract (docs/engine.md, "Same request, same answer"): one request gives the same
tokens and logprobs, bit for bit, cold, cached, with its prompt chunked, decoded alone or beside
7 others, on one thread or on all, with speculation off and on, greedy and seeded, on this CPU
and as an AVX2-only CPU (an AMD EPYC) computes it. The second run is a child process whose
torch, oneDNN and MKL are held to AVX2 and whose tandem ops are the x86-64-v3 build: what that
CPU would choose, checked here."""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
import sys

import pytest
import torch

from engine.layers import fused

DEMO = os.path.join(os.path.dirname(__file__), "..", "..", "demo", "tandem-demo")
PROMPT = [1] + [(i * 37) % 2900 + 3 for i in range(45)]  # 46 tokens: two full blocks and a tail
OTHERS = [[1] + [(i * 11 + j) % 2900 + 3 for i in range(8 + 5 * j)] for j in range(7)]
AVX2_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "TANDEM_OPS_MARCH": "x86-64-v3",
}


def variants(model: str, dtype: str, vocab: int = 2903) -> dict[str, list]:
    """Each case's (tokens, logprobs, top logprobs) for PROMPT, greedy and seeded, by case name
    (`vocab`: a smaller model's, the prompts' ids folded into it)."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    def engine(**overrides):
        return LLMEngine(
            EngineConfig(model=model, dtype=dtype, kv_cache_bytes=16 << 20, **overrides)
        )

    def result(completion):
        return [completion.token_ids, completion.logprobs, completion.top_logprobs]

    prompt = [t % vocab for t in PROMPT]
    others_prompts = [[t % vocab for t in p] for p in OTHERS]
    out = {}
    for kind, params in [
        ("greedy", SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, top_logprobs=3)),
        (
            "seeded",
            SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True, top_logprobs=3),
        ),
    ]:
        for speculative in ("off", "ngram"):
            warm = engine(speculative=speculative, num_speculative_tokens=6)
            out[f"{kind} {speculative} cold"] = result(warm.generate([prompt], params)[0])
            again = warm.generate([prompt], params)[0]
            assert again.num_cached_tokens == 32
            out[f"{kind} {speculative} cached"] = result(again)
        chunked = engine(max_num_batched_tokens=16, wave_batched_tokens=0).generate(
            [prompt], params
        )[0]
        out[f"{kind} chunked"] = result(chunked)
        # On one thread as on two (a worker leaves CPUs to its front end, and machines differ
        # in cores): the kernels split work by rows and columns, never a sum's terms. Explicit
        # counts: an earlier parallel engine in this process may have left it at one.
        threads = torch.get_num_threads()
        try:
            for n in (1, 2):
                single = engine(cpu_threads=n).generate([prompt], params)[0]
                out[f"{kind} {n} threads"] = result(single)
        finally:
            torch.set_num_threads(threads)
        # 7 requests decoding when this one arrives, and beside it until they finish.
        busy = engine(speculative="ngram", num_speculative_tokens=6)
        others = SamplingParams(max_tokens=24, temperature=0.7, ignore_eos=True)
        for i, other in enumerate(others_prompts):
            busy.add_request(f"other-{i}", other, others)
        for _ in range(3):
            busy.step()
        out[f"{kind} beside 7"] = result(busy.generate([prompt], params)[0])
    return out


def assert_all_equal(cases: dict[str, list]) -> None:
    for kind in ("greedy", "seeded"):
        reference = cases[f"{kind} off cold"]
        for name, value in cases.items():
            if name.startswith(kind):
                assert value == reference, f"{name} differs from {kind} off cold"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_request_gives_the_same_bits_in_every_case(dtype):
    assert_all_equal(variants(DEMO, dtype))


@pytest.mark.parametrize("arch", ["kimi_k25", "deepseek_v3_fp8", "gemma3", "gpt_oss"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_seeds_family_as_published_gives_the_same_bits_in_every_case(
    hf_checkpoint, arch, dtype
):
    """Multi-head latent attention (every head in one call), a mixture of experts (the chosen
    experts in one call a projection), INT4 and FP8 weights: as invariant as the dense model.
    Gemma 3 too: its GELU, fp32 norms and two windows' backends; and gpt-oss: attention sinks,
    MXFP4 experts with biases and the clamped SwiGLU."""
    from engine.config import ModelConfig

    folder = hf_checkpoint(arch)[1]
    assert_all_equal(variants(folder, dtype, ModelConfig.from_folder(folder).vocab_size))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_gguf_model_gives_the_same_bits_in_every_case(tmp_path, monkeypatch, dtype):
    """Weights kept in GGUF blocks (engine/csrc/gguf_linear.cpp): fp32 products, or bf16 ones
    (vdpbf16ps where the CPU has it) in bf16; the tile and the decode rows' direct sums alike."""
    from tests.gguf_files import T, write_tiny_gguf

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    kinds = dict(token_embd=T.Q8_0, output=T.Q6_K, attn=T.Q4_K, ffn=T.Q4_1)
    path = write_tiny_gguf(str(tmp_path / "tiny.gguf"), "llama", kinds)
    assert_all_equal(variants(path, dtype, vocab=2048))


def test_no_kernel_mix_a_cpu_could_measure_changes_a_bit(tmp_path, monkeypatch):
    """The invariant kernels never read the kernel cache: a cache holding an AMD EPYC's measured
    mix (plain at 1 row, oneDNN from 2) or an Intel's (oneDNN everywhere) gives the same bits."""
    from engine.config import ModelConfig
    from engine.layers import kernel_choice, linear

    reference = variants(DEMO, "float32")
    for mix in (["plain", "onednn", "onednn", "onednn", "onednn"], ["onednn"] * 5):
        cache = tmp_path / f"kernels-{mix[0]}.json"
        shapes = (
            "float32 384x256",
            "float32 256x256",
            "float32 1536x256",
            "float32 256x768",
            f"float32 {ModelConfig.from_folder(DEMO).vocab_size}x256",
        )
        cache.write_text(json.dumps({s: {"kernels": mix, "pack_hint": 16} for s in shapes}))
        monkeypatch.setenv("TANDEM_KERNEL_CACHE", str(cache))
        # reads it
        monkeypatch.setattr(linear, "kernel_choices", functools.cache(kernel_choice.KernelChoices))
        assert variants(DEMO, "float32") == reference, mix
        with (
            monkeypatch.context() as measured
        ):  # the same file is what the measured kernels would run
            measured.setenv("TANDEM_KERNELS", "measured")
            assert kernel_choice.KernelChoices().for_weight(torch.randn(384, 256)).kernels == tuple(
                mix
            )


@pytest.mark.skipif(
    platform.machine() != "x86_64" or fused.OPS is None, reason="x86-64 with the CPU ops built"
)
def test_the_same_bits_in_every_case_as_an_avx2_only_cpu_computes_them(hf_checkpoint):
    """The dense demo model, and Kimi K2.5's shape (MLA, grouped experts, INT4) as published."""
    from engine.config import ModelConfig

    fused.build(march="x86-64-v3")  # what `make install` builds on such a CPU
    kimi = hf_checkpoint("kimi_k25")[1]
    code = (
        "import json, sys; from engine.layers import fused; from engine.config import ModelConfig\n"
        "from tests.unit.test_invariance import variants, DEMO\n"
        "kimi = variants(sys.argv[1], 'float32', ModelConfig.from_folder(sys.argv[1]).vocab_size)\n"
        "print(json.dumps({'library': fused.library_path(march=fused.MARCH), 'cases': variants(DEMO, 'float32'),"
        " 'kimi': kimi}))"
    )
    env = {**os.environ, **AVX2_ENV}
    done = subprocess.run(
        [sys.executable, "-c", code, kimi],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=os.path.join(os.path.dirname(__file__), "..", ".."),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    child = json.loads(done.stdout.strip().splitlines()[-1])
    assert "x86-64-v3" in child["library"]
    assert_all_equal(child["cases"])
    assert_all_equal(child["kimi"])
    # and the same bits as this CPU computes: tokens, logprobs and top logprobs
    here = json.loads(
        json.dumps(
            {
                "cases": variants(DEMO, "float32"),
                "kimi": variants(kimi, "float32", ModelConfig.from_folder(kimi).vocab_size),
            }
        )
    )
    assert child["cases"] == here["cases"]
    assert child["kimi"] == here["kimi"]
