"""Triton kernels for CUDA: paged decode attention (paged_decode.py) and matmuls that read
quantized weights as published (quantized_matmul.py).

Without CUDA, compiled Triton cannot run, so its interpreter runs the same kernels on CPU
tensors (numpy underneath, slowly): that is how the tests check them on a machine with no GPU.
The choice is made here, before triton is imported: `triton.jit` fixes it for each function
it defines, triton.language's own included.
"""

import os
import sys

import torch

# TRITON_INTERPRET=0 set by hand keeps the kernels compiled without CUDA: to compile them for a
# GPU ahead of time (tests/unit/test_triton_compile.py).
if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") is None:
        raise RuntimeError(
            "triton was imported before engine.triton could choose its interpreter (there is no "
            "CUDA device): import engine.triton first, or set TRITON_INTERPRET=1"
        )
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The interpreter's tl.dot takes bf16 operands for integers (triton 3.7.1): kernels widen them to
# fp32 first there, which is exact (a bf16 product is exact in fp32, as the GPU's fp32 sum is).
WIDEN_DOT_OPERANDS = os.environ.get("TRITON_INTERPRET") == "1"
