"""A GGUF model's tensors under the engine's names, read with gguf-py's GGUFReader.

Every file of a split set is mapped (copy-on-write, as safetensors files are: engine/checkpoint.py)
and each tensor viewed over its mapping:
- F32, F16 and BF16 tensors as torch tensors;
- the types engine/csrc/gguf_linear.cpp multiplies as GgufWeights, still in their blocks;
- any other type (Q2_K, Q3_K, the IQ and TQ types) widened to fp32 once, with one line saying so.
llama.cpp's converter permutes the rows of a llama model's Q and K projections for its rope
(convert_hf_to_gguf.py's LlamaModel.permute); they are put back in Hugging Face's order here, as
transformers' GGUF loader does. Other architectures are stored unpermuted. gemma3's norms, stored
as 1 + w, are given back as w (engine/gguf/gemma3.py). deepseek2's
kv_b_proj, split per head into attn_k_b and attn_v_b by newer converters, is joined back dense
(engine/gguf/deepseek2.py).
"""

from __future__ import annotations

import logging
import os
import re

import numpy as np
import torch

from engine.errors import CheckpointError
from engine.gguf.deepseek2 import join_kv_b
from engine.gguf.gemma3 import hf_norm
from engine.gguf.names import expert_names, hf_name, split_kv_b
from engine.layers.quantized.gguf import KEPT_TYPES, GgufWeight
from engine.progress import Stage

log = logging.getLogger(__name__)

PERMUTED_ARCHITECTURES = ("llama",)  # Q and K rows permuted by llama.cpp's converter
DENSE = {"F32": torch.float32, "F16": torch.float16}


def open_reader(path: str):
    """gguf-py's reader over `path` (its arrays read lazily), or one line saying what is wrong
    with the file."""
    from engine.gguf.lazy_reader import LazyReader

    try:
        return LazyReader(path, "c")
    except ValueError as exc:
        if "GGMLQuantizationType" not in str(exc):
            raise _unreadable(path, exc) from exc
        kind = re.search(r"\((\d+)\)", str(exc))  # "np.uint32(99) is not a valid ..."
        raise CheckpointError(
            f"{path}: a tensor of type {kind.group(1) if kind else '?'}, which this gguf-py does not "
            "know (a newer llama.cpp's type?)"
        ) from exc
    except Exception as exc:  # gguf-py raises ValueError, KeyError, IndexError, numpy's errors
        raise _unreadable(path, exc) from exc


def _unreadable(path: str, exc: Exception) -> CheckpointError:
    return CheckpointError(
        f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc}); is it truncated or corrupt?"
    )


def field(reader, key: str, default=None):
    value = reader.fields.get(key)
    return default if value is None else value.contents()


def read_weights(
    paths: list[str], quiet: bool = False
) -> tuple[dict[str, torch.Tensor | GgufWeight], list]:
    """The tensors of a GGUF model's files by the engine's names, and the readers (which hold
    the mappings); their progress on stderr unless `quiet`."""
    readers = [open_reader(p) for p in paths]
    num_tensors = sum(len(r.tensors) for r in readers)
    label = f"reading {os.path.basename(paths[0])}"
    with Stage(label, num_tensors, "tensors", quiet=quiet) as progress:
        weights, widened = _read_weights(paths, readers, progress)
    for kind in sorted(widened):  # after the stage's line, not into its bar
        log.warning(
            "GGUF tensors of type %s are widened to fp32 at load (no kernel keeps them)", kind
        )
    return weights, readers


def _read_weights(
    paths: list[str], readers: list, progress: Stage
) -> tuple[dict[str, torch.Tensor | GgufWeight], set[str]]:
    """The tensors by the engine's names, and the types widened to fp32."""
    first = readers[0]
    arch = field(first, "general.architecture")
    heads = field(first, f"{arch}.attention.head_count")
    kv_heads = field(first, f"{arch}.attention.head_count_kv", heads)
    num_experts = field(first, f"{arch}.expert_count", 0)
    weights: dict[str, torch.Tensor | GgufWeight] = {}
    widened: set[str] = set()
    halves: dict[str, dict[str, torch.Tensor]] = {}  # deepseek2's kv_b_proj, split per head
    for path, reader in zip(paths, readers):
        for tensor in reader.tensors:
            progress.advance()
            split = split_kv_b(tensor.name)
            if split:
                halves.setdefault(split[0], {})[split[1]] = _dense(path, tensor)
                continue
            names = expert_names(tensor.name, num_experts) if num_experts else None
            name = hf_name(tensor.name, arch)
            if names is None and name is None:
                continue
            weight = _tensor(path, tensor, widened)
            if widened:  # dequantized here, in full: what makes a file slow to read
                progress.detail = f"{', '.join(sorted(widened))} widened to fp32"
            if arch in PERMUTED_ARCHITECTURES and name and ".self_attn." in name:
                if ".q_proj." in name:
                    weight = _unpermute(weight, heads)
                elif ".k_proj." in name:
                    weight = _unpermute(weight, kv_heads)
            if arch == "gemma3" and name and name.endswith("norm.weight"):
                weight = hf_norm(weight)  # stored as 1 + w
            if names is None:
                weights[name] = weight
                continue
            for e, expert in enumerate(names):
                weights[expert] = _expert(weight, e)
    for name, half in halves.items():
        if name not in weights:  # a file that also keeps attn_kv_b: that one is read
            if set(half) != {"k", "v"}:
                raise CheckpointError(
                    f"{paths[0]}: {name} has attn_k_b or attn_v_b without the other"
                )
            weights[name] = join_kv_b(half["k"], half["v"])
    return weights, widened


def _tensor(path: str, tensor, widened: set[str]) -> torch.Tensor | GgufWeight:
    kind = tensor.tensor_type
    cols = int(tensor.shape[0])  # gguf-py's shape is ggml's: innermost first
    data = np.asarray(tensor.data)
    try:
        if kind.name in DENSE:
            return torch.from_numpy(data).view(DENSE[kind.name])
        if kind.name == "BF16":
            return torch.from_numpy(data.view(np.int16)).view(torch.bfloat16)
        if int(kind) in KEPT_TYPES:
            rows = data.reshape(-1, data.shape[-1]) if data.ndim > 1 else data.reshape(1, -1)
            weight = GgufWeight(torch.from_numpy(rows), int(kind), cols, torch.float32)
            if data.ndim > 2:  # stacked experts: [experts, out, bytes]
                return torch.from_numpy(data), weight
            return weight
        from gguf.quants import dequantize

        widened.add(kind.name)
        return torch.from_numpy(dequantize(data, kind))
    except (ValueError, NotImplementedError, TypeError) as exc:
        raise CheckpointError(
            f"{path}: tensor {tensor.name!r} of type {kind.name} cannot be read: {exc}"
        ) from exc


def _dense(path: str, tensor) -> torch.Tensor:
    """A tensor of any type, dense: quantized ones dequantized to fp32 as gguf-py does."""
    from gguf.quants import dequantize

    try:
        if tensor.tensor_type.name == "BF16":
            return torch.from_numpy(np.asarray(tensor.data).view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(dequantize(np.asarray(tensor.data), tensor.tensor_type))
    except (ValueError, NotImplementedError, TypeError) as exc:
        raise CheckpointError(
            f"{path}: tensor {tensor.name!r} of type {tensor.tensor_type.name} cannot be read: {exc}"
        ) from exc


def _expert(weight, e: int):
    if isinstance(weight, tuple):  # quantized experts: expert e's rows of blocks
        stacked, whole = weight
        return GgufWeight(
            torch.from_numpy(np.asarray(stacked[e])), whole.kind, whole.cols, whole.dtype
        )
    return weight[e]


def _unpermute(weight, heads: int):
    """Hugging Face's row order from llama.cpp's: within each head, the rows came as (pair,
    half) and go back to (half, pair)."""
    rows = weight.shape[0]
    order = torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)
    if isinstance(weight, GgufWeight):
        return weight.rows(order)
    return weight.index_select(0, order)
