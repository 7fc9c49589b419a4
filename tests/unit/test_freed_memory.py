"""engine/cpu.py keep_freed_memory: the memory a step frees is reused by the next, not faulted in
anew (each page zeroed by the kernel)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

# Steps of a small model's activations, fresh tensors a layer as the engine allocates them
# (hidden 256, q/k/v 384, gate/up 1,536, its product 768), steps of 2,048, 512 and 64 tokens;
# prints the minor page faults of the steps after the first round of them.
STEPS = """
import resource, sys, torch
from engine.cpu import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def step(tokens):
    x = torch.empty(tokens, 256).fill_(1.0)
    for _ in range(4):
        qkv = torch.empty(tokens, 384).fill_(1.0)
        o = torch.empty(tokens, 256).fill_(1.0)
        del qkv
        gate_up = torch.empty(tokens, 1536).fill_(1.0)
        act = torch.empty(tokens, 768).fill_(1.0)
        del gate_up
        x = torch.empty(tokens, 256).fill_(1.0) + o
        del act, o
sizes = [2048, 512, 2048, 64, 2048, 512]
for tokens in sizes:
    step(tokens)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for tokens in sizes * 6:
    step(tokens)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(mode: str) -> int:
    run = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return int(run.stdout.split()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_the_memory_a_step_frees_is_reused_without_page_faults():
    default, kept = faults("default"), faults("keep")
    # glibc's default maps large blocks anew and trims its heap: a 2,048-token step's activations
    # (12 MB at most at once) fault in page by page, again and again (7,000-190,000 faults here,
    # against at most 1,800 kept)
    assert kept < 2_500 < default / 2, (kept, default)
