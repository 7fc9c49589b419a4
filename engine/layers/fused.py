"""The CPU ops of engine/csrc: fused_ops.cpp (RMSNorm, residual add + RMSNorm, rotary),
invariant_linear.cpp and invariant_attention.cpp (the batch-invariant matmul and paged
attention) and moe_experts.cpp (a mixture of experts' routed part on that matmul), built once
by `make install` (`python -m engine.layers.fused`) into one library, loaded at import.

Without a build (no C++ compiler, a changed source not rebuilt) or with `TANDEM_FUSED=0`, `OPS`
is None and the layers run their eager torch code, which computes the same values. The build
is plain `g++` against torch's headers and libraries (no ninja: a compiler process a source, as
many at once as there are CPUs, then a link), named by the source's hash, torch's version and the
CPU's instruction sets, so a stale library is never loaded.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

import torch

from engine import knobs
from engine.cpu import available_cpus, cpu_flags

log = logging.getLogger(__name__)

CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")
SOURCE_NAMES = (
    "fused_ops.cpp",
    "invariant_linear.cpp",
    "invariant_attention.cpp",
    "moe_experts.cpp",
    "latent_attention.cpp",
    "gguf_linear.cpp",
    "decoder_layer.cpp",
)
HEADER_NAMES = ("vec.h", "ops.h", "gguf_blocks.h", "gguf_products.h", "attention_units.h")
MARCH = knobs.ops_march()  # the build to load (engine/knobs.py)
BUILD_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "build", "fused"
)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def library_path(march: str = "native", namespace: str = "tandem", csrc: str = CSRC) -> str:
    """Named by the sources (`csrc`: another revision's, for bench/kernels.py), torch's version,
    the target, the op namespace and the CPU's instruction sets."""
    names = [n for n in SOURCE_NAMES + HEADER_NAMES if os.path.exists(os.path.join(csrc, n))]
    key = b"".join(_read(os.path.join(csrc, name)) for name in names)  # older revisions lack some
    key += f"{torch.__version__} {march} {namespace} {' '.join(sorted(cpu_flags()))}".encode()
    digest = hashlib.blake2b(key, digest_size=8).hexdigest()
    return os.path.join(BUILD_DIR, f"{namespace}_ops-{march}-{digest}.so")


def build(march: str = "native", namespace: str = "tandem", csrc: str = CSRC) -> str:
    """The library for `march` (-march=native for this CPU; tests also build x86-64-v3, what an
    AVX2-only CPU runs, under another op namespace so both load in one process)."""
    from torch.utils.cpp_extension import include_paths, library_paths

    path = library_path(march, namespace, csrc)
    sources = [os.path.join(csrc, name) for name in SOURCE_NAMES]
    if os.path.exists(path):
        return path
    os.makedirs(BUILD_DIR, exist_ok=True)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    flags = [
        "-O3",
        f"-march={march}",
        "-ffp-contract=off",
        "-fopenmp",
        "-fvisibility=hidden",  # each build loaded into one process calls its own functions
        "-std=c++20",
        "-fPIC",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-DTANDEM_OPS_NAMESPACE={namespace}",
        *(f"-I{p}" for p in include_paths()),
    ]
    compiler = os.environ.get("CXX", "g++")
    print(f"building {os.path.relpath(path)} (about a minute) ...", flush=True)
    with tempfile.TemporaryDirectory(dir=BUILD_DIR) as objects:
        # A source a compiler process, as many at once as this process has CPUs: most of each
        # one's time is torch's headers.
        outputs = [os.path.join(objects, os.path.basename(src) + ".o") for src in sources]
        with ThreadPoolExecutor(available_cpus()) as pool:
            compiled = [
                pool.submit(subprocess.run, [compiler, *flags, "-c", src, "-o", o], check=True)
                for src, o in zip(sources, outputs)
            ]
            for job in compiled:
                job.result()  # raises the first compiler error
        link = [compiler, "-shared", "-fopenmp", *outputs, "-o", path + ".tmp"]
        link += [f"-L{p}" for p in library_paths()]
        link += [f"-Wl,-rpath,{p}" for p in library_paths()]
        subprocess.run([*link, "-lc10", "-ltorch_cpu", "-ltorch"], check=True)
    os.replace(path + ".tmp", path)
    # stale builds of this target only: the digest is 16 hex digits, so x86-64's pattern does
    # not take x86-64-v3's builds
    stale = os.path.join(BUILD_DIR, f"{namespace}_ops-{march}-{'[0-9a-f]' * 16}.so")
    for old in glob.glob(stale):
        if old != path:
            os.remove(old)
    return path


def stale() -> str | None:
    """Why a process started now would find no CPU ops to load (engine/csrc edited since `make
    install` built them), or None: they are off (TANDEM_FUSED=0) or built. Benchmarks check it
    before each start of tandem, as a worker that finds none runs torch's kernels instead."""
    if not knobs.fused_ops():
        return None
    path = library_path(march=MARCH)
    if os.path.exists(path):
        return None
    return f"the CPU ops for engine/csrc as it is now are not built ({path}): run `make install`"


def _load() -> object | None:
    if not knobs.fused_ops():
        return None
    try:
        path = library_path(march=MARCH)
    except OSError:
        return None
    if not os.path.exists(path):
        log.info(
            "fused CPU ops not built (%s): eager torch ops instead; `make install` builds them",
            path,
        )
        return None
    try:
        torch.ops.load_library(path)
    except (OSError, RuntimeError) as exc:
        log.warning("fused CPU ops failed to load (%s): eager torch ops instead", exc)
        return None
    return torch.ops.tandem


OPS = _load()


def triton_usable(x: torch.Tensor) -> bool:
    """On CUDA the same ops are Triton kernels (engine/triton/fused_ops.py): for tensors whose last
    dimension is contiguous."""
    return x.device.type == "cuda" and x.stride(-1) == 1


def usable(x: torch.Tensor) -> bool:
    """The fused ops take CPU fp32 / bf16 tensors whose last dimension is contiguous."""
    return (
        OPS is not None
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and x.stride(-1) == 1
    )


if __name__ == "__main__":
    try:
        print(f"fused CPU ops: {build()}")
    except (subprocess.CalledProcessError, OSError) as exc:  # the engine runs without them
        print(f"fused CPU ops not built ({exc}); the engine uses eager torch ops", file=sys.stderr)
