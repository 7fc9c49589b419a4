"""The Triton kernels made for CUDA (engine/triton), compiled on a GPU and run in Triton's
interpreter without one: paged decode attention equals the torch backend's SDPA, the matmul on
FP8 blocks and INT4 groups equals the dequantized weight's, the fused experts equal the host's
dispatch, and the fused small ops equal eager torch's, each alone and inside an engine (decode
steps on the CUDA graphs' path; published quantized checkpoints)."""

from __future__ import annotations

import pytest
import torch

from engine import llm_engine
from engine.attention.base import AttentionBatch
from engine.attention.torch_backend import TorchBackend
from engine.config import EngineConfig
from engine.layers import fused, linear, moe
from engine.layers.norm import add_rms_norm
from engine.layers.norm import rms_norm as eager_rms_norm
from engine.layers.quantized.fp8 import Fp8BlockWeight
from engine.layers.quantized.int4 import Int4GroupWeight
from engine.layers.rotary import apply_rotary
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

pytest.importorskip("triton")
from engine.triton import fused_ops  # noqa: E402
from engine.triton.fused_moe import FusedExperts, sort_pairs  # noqa: E402
from engine.triton.paged_decode import paged_decode_attention  # noqa: E402
from engine.triton.quantized_matmul import quantized_matmul  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,latent,window,block_size,dtype",
    [
        (4, 2, 64, None, None, 16, torch.float32),  # grouped-query
        (6, 6, 32, None, None, 8, torch.float32),  # a tile spans pages smaller than itself
        (4, 1, 40, None, 7, 16, torch.float32),  # a sliding window; a head_dim padded to 64
        (40, 1, 96, 64, None, 16, torch.float32),  # MLA's latent; heads split over programs
        (4, 2, 64, None, None, 16, torch.bfloat16),
    ],
)
def test_paged_decode_equals_sdpa(heads, kv_heads, head_dim, latent, window, block_size, dtype):
    torch.manual_seed(1)
    backend = TorchBackend(
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        sliding_window=window,
        device=DEVICE,
        dtype=dtype,
        latent_v_dim=latent,
    )
    pool = torch.randn(
        24, 1 if latent else 2, block_size, kv_heads, head_dim, dtype=dtype, device=DEVICE
    )
    # Contexts of one token, within one page, across pages (tables out of order), past a tile.
    contexts = [1, block_size - 3, 2 * block_size + 5, 70]
    pages = torch.randperm(23)  # block 23 stays unused
    tables, at = [], 0
    for n in contexts:
        count = -(-n // block_size)
        tables.append(pages[at : at + count].tolist())
        at += count
    slots = torch.tensor(
        [
            t[(n - 1) // block_size] * block_size + (n - 1) % block_size
            for t, n in zip(tables, contexts)
        ],
        device=DEVICE,
    )
    batch = AttentionBatch([1] * len(contexts), contexts, tables, slots)
    q = torch.randn(len(contexts), heads, head_dim, dtype=dtype, device=DEVICE)
    k = torch.randn(len(contexts), kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v = None if latent else torch.randn_like(k)
    expected = backend.forward(q, k, v, pool, backend.plan(batch))  # writes the new K/V too
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [23] * (width - len(t)) for t in tables], device=DEVICE)
    got = paged_decode_attention(
        q, pool, padded, torch.tensor(contexts, device=DEVICE), backend.scale, window, latent
    )
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, expected, **tolerance)


GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=True)
PROMPTS = [list(range(10, 47)), [7, 8, 9], [42] * 20]


def _engine(folder: str, backend: str) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=folder,
            dtype="float32",
            device=str(DEVICE),
            kv_cache_bytes=8 << 20,
            attention_backend=backend,
            max_model_len=256,
        )
    )


@pytest.mark.parametrize("arch", ["llama", "mistral_window", "deepseek_v3"])
def test_engine_decodes_through_the_kernel_as_through_sdpa(hf_checkpoint, monkeypatch, arch):
    """The whole engine with the Triton backend, its decode steps on the CUDA graphs' path (run
    eagerly on CPU): the torch backend's tokens, and logprobs within rounding."""
    folder = hf_checkpoint(arch)[1]
    expected = _engine(folder, "torch").generate(PROMPTS, GREEDY)
    monkeypatch.setattr(llm_engine, "decode_graphs_wanted", lambda *args: True)
    engine = _engine(folder, "triton")
    graphs = engine.runner.graphs
    replays = []
    replay = graphs.replay
    monkeypatch.setattr(graphs, "replay", lambda step: replays.append(step) or replay(step))
    got = engine.generate(PROMPTS, GREEDY)
    assert replays  # decode steps took the graphs' path
    for a, b in zip(expected, got):
        assert b.token_ids == a.token_ids
        torch.testing.assert_close(
            torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=1e-4, atol=1e-4
        )


def _fp8_weight(out: int, inputs: int, dtype: torch.dtype) -> Fp8BlockWeight:
    blocks = (-(-out // 128), -(-inputs // 128))
    return Fp8BlockWeight(
        torch.randn(out, inputs, device=DEVICE).to(torch.float8_e4m3fn),
        torch.rand(blocks, device=DEVICE) / 50,
        dtype,
    )


def _int4_weight(out: int, inputs: int, dtype: torch.dtype, group: int = 32) -> Int4GroupWeight:
    packed = torch.randint(0, 256, (out, inputs // 2), dtype=torch.uint8, device=DEVICE)
    scale = torch.rand(out, inputs // group, device=DEVICE) / 50
    return Int4GroupWeight(packed, scale.bfloat16(), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "make,out,inputs",
    [
        (_fp8_weight, 200, 300),  # partial blocks at both edges
        (_fp8_weight, 256, 384),
        (_int4_weight, 130, 96),  # rows past a tile; inputs short of one
        (_int4_weight, 64, 320),
    ],
)
@pytest.mark.parametrize("rows,splits", [(1, None), (1, 3), (20, None), (70, 2)])
def test_quantized_matmul_equals_the_dequantized_weight(make, out, inputs, dtype, rows, splits):
    torch.manual_seed(2)
    weight = make(out, inputs, dtype)
    x = torch.randn(rows, inputs, dtype=dtype, device=DEVICE)
    expected = (x.float() @ weight.dequantize().float().T).to(dtype)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(quantized_matmul(x, weight, splits), expected, **tolerance)


@pytest.mark.parametrize("arch", ["deepseek_v3_fp8", "kimi_k25"])
def test_engine_on_published_quantized_weights_through_triton(hf_checkpoint, monkeypatch, arch):
    """DeepSeek-V3's FP8 blocks and Kimi K2.5's INT4 experts multiplied by Triton's matmul, kept
    quantized: the tokens of the weights dequantized at load, logprobs within rounding."""
    folder = hf_checkpoint(arch)[1]
    monkeypatch.setattr(linear, "quantized_kernel", lambda weight: "dense")
    expected = _engine(folder, "torch").generate(PROMPTS, GREEDY)  # the weights dequantized
    calls = []
    monkeypatch.setattr(linear, "quantized_kernel", lambda weight: calls.append(weight) or "triton")
    got = _engine(folder, "triton").generate(PROMPTS, GREEDY)
    assert calls and all(type(w) is QUANTIZED_KIND[arch] for w in calls)
    for a, b in zip(expected, got):
        assert b.token_ids == a.token_ids
        torch.testing.assert_close(
            torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=1e-4, atol=1e-4
        )


QUANTIZED_KIND = {"deepseek_v3_fp8": Fp8BlockWeight, "kimi_k25": Int4GroupWeight}


def test_gpu_checks_bandwidth_lane_dry_runs(capsys):
    """bench/gpu_check.py's bandwidth-bound shapes, cut small (`--dry`), run end to end here, so
    the script a GPU session gets is not first run there: every shape and weight kind loads from
    weights made in memory, and each graphs engine writes its eager engine's tokens."""
    from bench.gpu_check import measure_shape, print_shapes

    rows = [
        row
        for shape in ("llama-8b", "kimi-moe")
        for kind in ("bfloat16", "fp8", "int4")
        for row in measure_shape(shape, kind, "cpu", repeats=1, dry=True)
    ]
    print_shapes(rows, bandwidth=1e10)
    assert [(r["shape"], r["mode"]) for r in rows][:2] == [
        ("llama-8b-bfloat16", "eager"),
        ("llama-8b-bfloat16", "graphs"),
    ]
    assert len(rows) == 12 and all(r["greedy_equal"] for r in rows)
    by_shape = {r["shape"]: r for r in rows}
    for shape in ("llama-8b", "kimi-moe"):  # kept quantized: fewer bytes held and read
        bf16, fp8, int4 = (by_shape[f"{shape}-{k}"] for k in ("bfloat16", "fp8", "int4"))
        assert int4["read_bytes"] < bf16["read_bytes"] and fp8["read_bytes"] < bf16["read_bytes"]
        assert fp8["resident_bytes"] < bf16["resident_bytes"]
    assert "b64 tok/s" in capsys.readouterr().out


@pytest.mark.parametrize(
    "tokens,top_k,experts,block_m", [(1, 2, 4, 16), (37, 3, 8, 16), (50, 4, 5, 64)]
)
def test_sort_pairs_groups_every_pair_by_expert_in_padded_blocks(tokens, top_k, experts, block_m):
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).to(DEVICE)
    pairs, block_expert, used = sort_pairs(ids, experts, block_m)
    num_pairs, flat = tokens * top_k, ids.flatten().cpu()
    assert pairs.numel() == num_pairs + experts * (block_m - 1)  # fixed by the shapes alone
    pairs, block_expert, used = pairs.cpu(), block_expert.cpu(), int(used)
    real = pairs[pairs < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair once
    assert used % block_m == 0 and (pairs[used:] == num_pairs).all()
    for b in range(used // block_m):
        block = pairs[b * block_m : (b + 1) * block_m]
        block = block[block < num_pairs]
        assert len(block) and (flat[block] == block_expert[b]).all()  # one expert a block
        assert block.tolist() == sorted(block.tolist())  # in pair order within the expert


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "deepseek_v3_fp8", "kimi_k25"])
def test_fused_experts_equal_the_host_dispatch_inside_decode_graphs(
    hf_checkpoint, monkeypatch, arch
):
    """Every mixture of experts (softmax and grouped-sigmoid routers; bf16, FP8 and INT4 experts)
    through the fused experts, as on CUDA: the model captures, its decode steps take the graphs'
    path, and its tokens are those of the host's dispatch over the weights dequantized."""
    folder = hf_checkpoint(arch)[1]
    monkeypatch.setenv("TANDEM_KERNELS", "plain")  # Linears keep their weights, as on CUDA
    monkeypatch.setattr(linear, "quantized_kernel", lambda weight: "dense")
    monkeypatch.setattr(moe, "fused_experts", lambda experts: None)
    expected = _engine(folder, "torch").generate(PROMPTS, GREEDY)
    monkeypatch.setattr(linear, "quantized_kernel", lambda weight: "triton")
    fused = []
    monkeypatch.setattr(
        moe, "fused_experts", lambda experts: fused.append(FusedExperts.of(experts)) or fused[-1]
    )
    monkeypatch.setattr(llm_engine, "decode_graphs_wanted", lambda *args: True)
    engine = _engine(folder, "triton")
    assert fused and all(f is not None for f in fused) and engine.model.capturable
    replays = []
    replay = engine.runner.graphs.replay
    monkeypatch.setattr(engine.runner.graphs, "replay", lambda s: replays.append(s) or replay(s))
    got = engine.generate(PROMPTS, GREEDY)
    assert replays
    for a, b in zip(expected, got):
        assert b.token_ids == a.token_ids
        torch.testing.assert_close(
            torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=1e-4, atol=1e-4
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_small_ops_equal_eager_torch(monkeypatch, dtype):
    monkeypatch.setattr(fused, "usable", lambda x: False)  # eager torch, the reference
    # fp32: rounding apart; bf16: a few units in the last place
    tolerance = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=3e-2, atol=2e-2)
    x = torch.randn(5, 200, dtype=dtype, device=DEVICE)
    residual = torch.randn_like(x)
    weight = torch.rand(200, dtype=dtype, device=DEVICE) + 0.5
    torch.testing.assert_close(
        fused_ops.rms_norm(x, weight, 1e-6), eager_rms_norm(x, weight, 1e-6), **tolerance
    )
    heads = x.view(5, 4, 50)  # per-head norms (Qwen3's q_norm)
    torch.testing.assert_close(
        fused_ops.rms_norm(heads, weight[:50], 1e-6),
        eager_rms_norm(heads, weight[:50], 1e-6),
        **tolerance,
    )
    for got, expected in zip(
        fused_ops.rms_norm(x, weight, 1e-6, residual), add_rms_norm(x, residual, weight, 1e-6)
    ):
        torch.testing.assert_close(got, expected, **tolerance)
    q = torch.randn(3, 6, 64, dtype=dtype, device=DEVICE)[:, 1:5]  # a view: heads strided
    cos, sin = torch.randn(2, 3, 1, 32, dtype=dtype, device=DEVICE)
    for interleaved in (False, True):
        torch.testing.assert_close(
            fused_ops.rotary(q, cos, sin, interleaved),
            apply_rotary(q, (cos, sin), interleaved),
            **tolerance,
        )
    gate_up = torch.randn(7, 2 * 1500, dtype=dtype, device=DEVICE)  # two column blocks a row
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(
        fused_ops.silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up, **tolerance
    )


@pytest.mark.parametrize("arch", ["llama", "qwen3", "deepseek_v3"])
def test_engine_with_the_fused_small_ops(hf_checkpoint, monkeypatch, arch):
    """A model's norms, rotary embeddings (interleaved for DeepSeek) and activations through the
    Triton ops, as on CUDA: eager torch's tokens, logprobs within rounding."""
    folder = hf_checkpoint(arch)[1]
    monkeypatch.setattr(fused, "usable", lambda x: False)
    monkeypatch.setattr(fused, "triton_usable", lambda x: False)
    expected = _engine(folder, "torch").generate(PROMPTS, GREEDY)
    calls = []
    monkeypatch.setattr(fused, "triton_usable", lambda x: calls.append(x) or x.stride(-1) == 1)
    got = _engine(folder, "torch").generate(PROMPTS, GREEDY)
    assert calls
    for a, b in zip(expected, got):
        assert b.token_ids == a.token_ids
        torch.testing.assert_close(
            torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=1e-4, atol=1e-4
        )


def test_every_kernel_variant_compiles_for_an_h100():
    """Triton's GPU compiler, ahead of time and without a GPU, on every kernel variant the
    engine launches (tests/triton_aot.py): it refuses programs the interpreter runs."""
    import os
    import pathlib
    import subprocess
    import sys

    import triton

    if not (pathlib.Path(triton.__file__).parent / "backends/nvidia/bin/ptxas").exists():
        pytest.skip("this triton build has no ptxas")
    done = subprocess.run(
        [sys.executable, str(pathlib.Path(__file__).parents[1] / "triton_aot.py")],
        env={**os.environ, "TRITON_INTERPRET": "0"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "18 of 18 launches compiled" in done.stdout
