"""Compiles every Triton kernel variant the engine launches, for an H100/H200 (sm_90), on a
machine with no GPU: Triton's own compiler and ptxas, ahead of time. The interpreter the tests
run the kernels in takes programs the GPU compiler refuses (a dot under 16 wide, mixed types
across branches, an unsupported cast), so this is what stands between them and a GPU session's
one try.

Each wrapper in engine/triton is called with CPU tensors of the dtypes and shapes the engine
uses; its kernel launches are recorded instead of run, and each recorded launch is compiled
from its arguments' types and constexprs. Run by tests/unit/test_triton_kernels.py in a
process of its own (TRITON_INTERPRET=0 must be set before triton is imported):

    TRITON_INTERPRET=0 python tests/triton_aot.py
"""

from __future__ import annotations

import os
import sys
import time

assert os.environ.get("TRITON_INTERPRET") == "0", "run with TRITON_INTERPRET=0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from engine.layers.quantized.fp8 import Fp8BlockWeight  # noqa: E402
from engine.layers.quantized.int4 import Int4GroupWeight  # noqa: E402
from engine.triton import fused_moe, fused_ops, paged_decode, quantized_matmul  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)  # H100 / H200
TYPES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.uint8: "u8",
    torch.int32: "i32",
    torch.int64: "i64",
}
launches: list[tuple[str, object, tuple, dict]] = []


class Recorder:
    """Stands in for a kernel: `kernel[grid](...)` records the call."""

    def __init__(self, kernel, label: str):
        self.kernel, self.label = kernel, label

    def __getitem__(self, grid):
        return lambda *args, **kwargs: launches.append((self.label, self.kernel, args, kwargs))


def arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + TYPES[value.dtype]
    if isinstance(value, float):
        return "fp32"
    return "i64" if abs(value) >= 2**31 else "i32"


def compile_launch(kernel, args: tuple, kwargs: dict):
    names = kernel.arg_names
    signature = {name: arg_type(value) for name, value in zip(names, args)}
    signature.update({name: "constexpr" for name in kwargs})
    source = ASTSource(fn=kernel, signature=signature, constexprs=dict(kwargs))
    return triton.compile(source, target=TARGET)


def record_every_variant() -> None:
    for module, name in (
        (paged_decode, "_paged_decode"),
        (quantized_matmul, "_quantized_matmul"),
        (fused_moe, "_expert_matmul"),
        (fused_ops, "_rms_norm"),
        (fused_ops, "_rotary"),
        (fused_ops, "_silu_and_mul"),
    ):
        setattr(module, name, Recorder(getattr(module, name), name))

    def decode(dtype, heads, kv_heads, head_dim, latent=None, window=None):
        pool = torch.zeros(4, 1 if latent else 2, 16, kv_heads, head_dim, dtype=dtype)
        q = torch.zeros(2, heads, head_dim, dtype=dtype)
        tables, lens = torch.zeros(2, 3, dtype=torch.long), torch.ones(2, dtype=torch.long)
        paged_decode.paged_decode_attention(q, pool, tables, lens, 0.1, window, latent)

    decode(torch.bfloat16, 32, 8, 128)  # Llama-3-8B
    decode(torch.float32, 32, 8, 128, window=4096)
    decode(torch.bfloat16, 64, 1, 576, latent=512)  # Kimi / DeepSeek MLA
    fp8 = Fp8BlockWeight(
        torch.zeros(512, 4096, dtype=torch.float8_e4m3fn), torch.ones(4, 32), torch.bfloat16
    )
    int4 = Int4GroupWeight(
        torch.zeros(512, 1024, dtype=torch.uint8),
        torch.ones(512, 64, dtype=torch.bfloat16),
        torch.bfloat16,
    )
    for weight, rows in ((fp8, 1), (fp8, 100), (int4, 1), (int4, 100)):
        quantized_matmul.quantized_matmul(
            torch.zeros(rows, weight.shape[1], dtype=torch.bfloat16), weight
        )
    bf16 = torch.bfloat16
    experts = {  # four experts' gate/up [512, 256] and down [256, 256], as each kind stores them
        "bf16": lambda n: torch.zeros(n, 256, dtype=bf16),
        "fp8": lambda n: Fp8BlockWeight(
            torch.zeros(n, 256, dtype=torch.float8_e4m3fn), torch.ones(n // 128, 2), bf16
        ),
        "int4": lambda n: Int4GroupWeight(
            torch.zeros(n, 128, dtype=torch.uint8), torch.ones(n, 8, dtype=bf16), bf16
        ),
    }
    for make in experts.values():
        fused = fused_moe.FusedExperts(
            fused_moe._stacked([make(512)] * 4), fused_moe._stacked([make(256)] * 4)
        )
        fused(
            torch.zeros(3, 256, dtype=bf16),
            torch.ones(3, 2),
            torch.tensor([[0, 1], [2, 3], [1, 2]]),
        )
    x = torch.zeros(3, 4096, dtype=torch.bfloat16)
    fused_ops.rms_norm(x, torch.ones(4096, dtype=torch.bfloat16), 1e-6)
    fused_ops.rms_norm(x, torch.ones(4096, dtype=torch.bfloat16), 1e-6, torch.zeros_like(x))
    q = torch.zeros(3, 32, 128, dtype=torch.bfloat16)
    cos = torch.zeros(3, 1, 64, dtype=torch.bfloat16)
    fused_ops.rotary(q, cos, cos, False)
    fused_ops.rotary(
        torch.zeros(3, 64, 64, dtype=torch.bfloat16), cos[..., :32], cos[..., :32], True
    )
    fused_ops.silu_and_mul(torch.zeros(3, 2 * 14336, dtype=torch.bfloat16))


def main() -> int:
    record_every_variant()
    failed = 0
    for label, kernel, args, kwargs in launches:
        started = time.perf_counter()
        try:
            compile_launch(kernel, args, kwargs)
            print(
                f"ok    {label} {sorted(kwargs.items())} ({time.perf_counter() - started:.1f} s)",
                flush=True,
            )
        except Exception as exc:  # a compile error names the kernel and its constexprs
            failed += 1
            print(
                f"FAIL  {label} {sorted(kwargs.items())}: {type(exc).__name__}: {exc}", flush=True
            )
    print(f"{len(launches) - failed} of {len(launches)} launches compiled for sm_{TARGET.arch}")
    return 1 if failed or not launches else 0


if __name__ == "__main__":
    sys.exit(main())
