"""Which matmul kernel each weight shape gets.

By default (`TANDEM_KERNELS=invariant`) every CPU fp32 and bf16 weight gets the batch-invariant
kernel (engine/csrc/invariant_linear.cpp): each output is summed in one fixed order, so a
token's row is the same bits alone or in any batch, cached or not, on every x86-64 CPU. That is
what makes a request's tokens and logprobs independent of what runs beside it. Library kernels
are not: on a 2-core Xeon, MKL's and oneDNN's rows already differ between 1 and 300 rows, and
which rows differ changes with the CPU (bench/README.md).

`TANDEM_KERNELS=measured` gives that up for speed (bf16 prompts on AMX CPUs: several times
faster): the fastest kernel per weight shape and bucket of rows, measured on this machine once,
then read from a cache. The fastest CPU matmul depends on the CPU, the dtype, the shape and
the number of rows. On a 2-core Intel Xeon (AVX-512, AMX), for example, torch's plain fp32 matmul beats oneDNN's
prepacked one by 10-40% at one row and loses by 20-40% at 4-16 rows, and oneDNN's prepacked
bf16 is 2x torch's plain bf16 at every size; on AMD CPUs MKL takes a generic path. So at load,
each distinct (dtype, out, in) of the model is timed for each bucket of rows (1, 2-4, 5-16,
17-64, 65+, timed at the top of each) with every candidate:

- `plain`: `F.linear` on the weight as loaded;
- `onednn1`, `onednn16`: oneDNN's `_linear_pointwise` on the weight reordered into its blocked
  layout for an expected 1 or 16 rows (one of them is kept per shape: the better in total);
- `widen`: bf16 computed in fp32, only on CPUs without bf16 arithmetic.

A candidate other than `plain` is chosen only when it is at least `MARGIN` faster, so a near
tie resolves the same way on every run. Choices are cached in a JSON file per CPU model,
torch version and thread count (`~/.cache/tandem/`, or `TANDEM_KERNEL_CACHE=FILE`), written
under a file lock: every process on a machine reads the same choices, so a request gets the
same tokens in each process (but not in each batch). `remeasure` measures again;
`TANDEM_KERNELS=plain|onednn` skips the measurement (baselines for benchmarks).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine import knobs
from engine.cpu import cpu_flags, cpu_has_native_bf16, cpu_model
from engine.layers import fused

log = logging.getLogger(__name__)

BUCKET_ROWS = (1, 4, 16, 64, 256)  # each bucket is timed at its largest row count
PACK_HINTS = (1, 16)
MARGIN = 0.05
ROUNDS = 5
MIN_REPEAT_S = 0.5e-3  # a timed sample repeats a call until it takes at least this long
BUSY_SHARE = 0.8  # below this share of its threads' CPU time, a measurement is flagged


def bucket_of(rows: int) -> int:
    """1 -> 0, 2-4 -> 1, 5-16 -> 2, 17-64 -> 3, 65+ -> 4."""
    return min(((max(rows, 1) - 1).bit_length() + 1) // 2, len(BUCKET_ROWS) - 1)


def emulated_bf16(x: torch.Tensor) -> bool:
    """True where bf16 math would be emulated: compute such matmuls in fp32 instead."""
    return x.dtype is torch.bfloat16 and x.device.type == "cpu" and not cpu_has_native_bf16()


PANEL = 4  # blocks a panel interleaves (engine/csrc/invariant_linear.cpp's kLayoutPanel)
TINY = 2.0**-55  # bf16 weights (and, in the kernel, activations) below it are zero


def invariant_pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [ceil(out / 16), in, 16], the batch-invariant kernel's blocks of 16 outputs
    (zero rows past out), for a CPU fp32 or bf16 weight, or a quantized one's bytes
    (engine/layers/quantized). In memory the blocks are in panels of PANEL (the last one
    narrower), each interleaved by k: [in, panel's blocks, 16], so a tile reads one stream.
    bf16 weights go in pairs of k (in rounded up to even, below TINY zero): [in / 2, panel's
    blocks, 16 columns x (k + 1, k)], each column's k and k + 1 one 32-bit word with k in the
    high half, which AVX512-BF16's dot product adds first (engine/csrc/invariant_linear.cpp's
    tile_bf16; its zeroing keeps every product it sums from being subnormal, which it flushes)."""
    out, cols = weight.shape
    blocks = -(-out // 16)
    pairs = weight.dtype is torch.bfloat16
    if pairs:
        weight = weight.masked_fill(weight.abs() < TINY, 0)
    stored = cols + cols % 2 if pairs else cols
    padded = F.pad(weight, (0, stored - cols, 0, blocks * 16 - out)).view(blocks, 16, stored)
    if pairs:  # a block's rows: pairs of k, each its 16 columns' (k + 1, k)
        rows = padded.view(blocks, 16, stored // 2, 2).flip(-1).permute(0, 2, 1, 3)
        rows = rows.reshape(blocks, stored // 2, 32)
    else:  # a block's rows: k, each its 16 columns
        rows = padded.transpose(1, 2)
    steps, item = rows.shape[1:]
    whole = blocks // PANEL * PANEL
    panels = [rows[:whole].reshape(-1, PANEL, steps, item).permute(0, 2, 1, 3).reshape(-1)]
    if whole < blocks:
        panels.append(rows[whole:].permute(1, 0, 2).reshape(-1))
    return torch.cat(panels).view(blocks, stored, 16)


def invariant_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    out: int,
    scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """`scales`: a quantized weight's (engine/layers/quantized, `invariant_form`)."""
    return fused.OPS.invariant_linear(
        x if x.stride(-1) == 1 else x.contiguous(), packed, bias, out, scales
    )


def invariant_linear_silu(
    x: torch.Tensor, packed: torch.Tensor, width: int, scales: torch.Tensor | None = None
) -> torch.Tensor:
    """silu(gate) * up of a packed gate_up weight (gate's `width` outputs, then up's) in one pass:
    the bits of silu_and_mul of invariant_linear (width a multiple of 128)."""
    return fused.OPS.invariant_linear_silu(
        x if x.stride(-1) == 1 else x.contiguous(), packed, width, scales
    )


def onednn_pack(weight: torch.Tensor, hint: int) -> torch.Tensor | None:
    if (
        weight.device.type != "cpu"
        or weight.dtype not in (torch.float32, torch.bfloat16)
        or not torch.backends.mkldnn.is_available()
    ):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, hint)
    except (RuntimeError, AttributeError):  # a torch build without these ops
        return None


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def widened_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """bf16 computed in fp32 (~3x faster than emulated bf16 for several rows)."""
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


@dataclass(frozen=True)
class Choice:
    """The kernel per bucket of rows, and the pack hint of the oneDNN form (0: none kept)."""

    kernels: tuple[str, ...]  # invariant (every bucket) | plain | onednn | widen, one per bucket
    pack_hint: int

    def to_json(self) -> dict:
        return {"kernels": list(self.kernels), "pack_hint": self.pack_hint}

    @staticmethod
    def from_json(data: dict) -> Choice:
        return Choice(tuple(data["kernels"]), int(data["pack_hint"]))

    def describe(self) -> str:
        return ", ".join(
            f"{k if k != 'onednn' else f'onednn{self.pack_hint}'} at {rows}"
            for k, rows in zip(self.kernels, ("1", "2-4", "5-16", "17-64", "65+"))
        )


def _time_interleaved(fns: dict[str, Callable[[], object]]) -> dict[str, float]:
    """Seconds per call of each: the best of ROUNDS samples, taken in turn (so a burst of other
    work on the machine hits every candidate alike), each sample long enough to time."""
    once = {}
    for name, fn in fns.items():
        fn()  # warm-up
        start = time.perf_counter()
        fn()
        once[name] = max(time.perf_counter() - start, 1e-7)
    repeat = {name: max(1, int(MIN_REPEAT_S / t)) for name, t in once.items()}
    rounds = ROUNDS if max(once.values()) < 0.02 else 2  # calls of tens of ms: fewer samples
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(repeat[name]):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / repeat[name])
    return best


@torch.inference_mode()
def measure(weight: torch.Tensor) -> tuple[Choice, float]:
    """Times every candidate for each bucket on `weight` itself; the caller keeps the winners.
    Also returns the share of its threads' time the process got (below ~0.8: the machine was busy)."""
    dtype = weight.dtype
    candidates: dict[str, Callable[[torch.Tensor], object]] = {
        "plain": lambda x: F.linear(x, weight)
    }
    for hint in PACK_HINTS:
        packed = onednn_pack(weight, hint)
        if packed is not None:
            candidates[f"onednn{hint}"] = lambda x, packed=packed: onednn_linear(x, packed, None)
    if dtype is torch.bfloat16 and not cpu_has_native_bf16():
        candidates["widen"] = lambda x: widened_linear(x, weight, None)
    wall, cpu = time.perf_counter(), time.process_time()
    by_bucket = []
    for rows in BUCKET_ROWS:
        x = torch.randn(rows, weight.shape[1]).to(dtype)
        by_bucket.append(
            _time_interleaved({name: (lambda fn=fn: fn(x)) for name, fn in candidates.items()})
        )
    share = (time.process_time() - cpu) / ((time.perf_counter() - wall) * torch.get_num_threads())
    packs = [name for name in candidates if name.startswith("onednn")]
    pack = min(packs, key=lambda name: sum(t[name] for t in by_bucket)) if packs else None
    kernels = []
    for times in by_bucket:
        best = min(
            (name for name in times if not name.startswith("onednn") or name == pack), key=times.get
        )
        if times[best] > (1 - MARGIN) * times["plain"]:
            best = "plain"
        kernels.append("onednn" if best == pack else best)
    return Choice(
        tuple(kernels), int(pack.removeprefix("onednn")) if "onednn" in kernels else 0
    ), share


def cache_path() -> str:
    if knobs.kernel_cache():
        return knobs.kernel_cache()
    key = "|".join(
        [
            cpu_model(),
            ",".join(sorted(cpu_flags())),
            torch.__version__,
            str(torch.get_num_threads()),
        ]
    )
    folder = os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "tandem"
    )
    return os.path.join(
        folder, f"kernels-{hashlib.blake2b(key.encode(), digest_size=8).hexdigest()}.json"
    )


def shape_key(weight: torch.Tensor) -> str:
    return f"{str(weight.dtype).removeprefix('torch.')} {weight.shape[0]}x{weight.shape[1]}"


@contextlib.contextmanager
def _locked(path: str):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


class KernelChoices:
    """This process's choices, read from and added to the machine's cache file."""

    def __init__(self):
        self.path = cache_path()
        self.choices = {key: Choice.from_json(value) for key, value in _read(self.path).items()}
        self.measured: set[str] = set()
        if self.choices:
            log.info("matmul kernels: %d shapes read from %s", len(self.choices), self.path)

    def for_weight(self, weight: torch.Tensor) -> Choice:
        """`TANDEM_KERNELS`: invariant (the default), measured (cached, else measured), remeasure,
        plain or onednn (no measuring)."""
        forced = kernels_setting()
        if weight.device.type != "cpu" or forced == "plain":
            return Choice(("plain",) * len(BUCKET_ROWS), 0)
        if forced == "invariant":
            if weight.dtype in (torch.float32, torch.bfloat16) and invariant_available():
                return Choice(("invariant",) * len(BUCKET_ROWS), 0)
            forced = "measured"  # other dtypes; a build without the op (warned once)
        if forced == "onednn":  # the hint tandem packed with before kernels were measured
            return Choice(("onednn",) * len(BUCKET_ROWS), 4)
        key = shape_key(weight)
        if key not in self.choices or (forced == "remeasure" and key not in self.measured):
            self._measure(key, weight, forced == "remeasure")
        return self.choices[key]

    def _measure(self, key: str, weight: torch.Tensor, again: bool) -> None:
        self.measured.add(key)
        try:
            with _locked(self.path):
                stored = _read(self.path)  # another process may have measured it meanwhile
                if key in stored and not again:
                    self.choices[key] = Choice.from_json(stored[key])
                    return
                start = time.perf_counter()
                choice, share = measure(weight)
                self.choices[key] = choice
                stored[key] = choice.to_json()
                tmp = f"{self.path}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:  # one line per shape
                    f.write(
                        "{\n"
                        + ",\n".join(
                            f" {json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(stored.items())
                        )
                        + "\n}\n"
                    )
                os.replace(tmp, self.path)
        except OSError as exc:  # no writable cache: this process's own measurement
            log.warning(
                "matmul kernels: cannot use the cache %s (%s); measuring for this process only",
                self.path,
                exc,
            )
            start = time.perf_counter()
            choice, share = measure(weight)
            self.choices[key] = choice
        log.info(
            "matmul kernels: %s measured in %.2fs: %s",
            key,
            time.perf_counter() - start,
            choice.describe(),
        )
        if share < BUSY_SHARE:
            log.warning(
                "matmul kernels: the machine was busy while %s was measured (this process got %.0f%% of its "
                "threads' time), so the choice may be off; remeasure on an idle machine with "
                "`python -m engine.layers.remeasure --model DIR`",
                key,
                100 * share,
            )


def kernels_setting() -> str:
    return knobs.kernels()


def invariant_kernels() -> bool:
    """The batch-invariant kernels are on: the setting says so and they are built."""
    return kernels_setting() == "invariant" and invariant_available()


@functools.cache
def invariant_available() -> bool:
    if (
        fused.OPS is not None
        and hasattr(fused.OPS, "invariant_linear")
        and hasattr(fused.OPS, "paged_attention")
    ):
        return True
    log.warning(
        "the batch-invariant matmul is not built (`make install` builds it): measured kernels instead, so "
        "a request's logprobs may change in their last bits with what is batched beside it"
    )
    return False


@functools.cache
def kernel_choices() -> KernelChoices:
    return KernelChoices()
