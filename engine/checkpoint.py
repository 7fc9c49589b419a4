"""Weights from a Hugging Face folder, memory-mapped straight out of *.safetensors files.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the raw bytes. We map each file once
(copy-on-write, so nothing can write back to disk) and view every tensor over the mapping:
no bytes are read until a weight is first used, nothing passes through Python objects, and
start-up is bounded by the disk. (The model then keeps norms and embeddings as these views
and repacks matmul weights once for its kernels.)
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct
from collections.abc import Iterator

import torch

from engine.errors import CheckpointError
from engine.gguf import folder as gguf_folder
from engine.gguf.reader import read_weights as read_gguf

SAFETENSORS_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,  # a published EAGLE-3 head's t2d mask
    "F8_E4M3": torch.float8_e4m3fn,  # FP8 block-quantized weights (engine/layers/quantized/fp8.py)
}
INDEX_FILE = "model.safetensors.index.json"


def weight_files(folder: str) -> list[str]:
    """The checkpoint's safetensors files: the index's shards, else model.safetensors."""
    index_path = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"{index_path}: not a valid safetensors index: {exc}") from exc
        names = sorted(set(weight_map.values()))
    else:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if not names:
        raise CheckpointError(
            f"{folder}: no *.safetensors weights (only safetensors checkpoints are supported)"
        )
    paths = [os.path.join(folder, n) for n in names]
    for path in paths:
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: weights file listed in the index is missing")
    return paths


def read_safetensors(
    path: str, mappings: list[mmap.mmap] | None = None, prefix: str = ""
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs viewing a memory mapping of the file (appended to `mappings`), of the
    tensors whose names start with `prefix`."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes)")
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > size - 8:
            raise CheckpointError(f"{path}: corrupt safetensors header (claims {header_len} bytes)")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, ValueError) as exc:
            raise CheckpointError(f"{path}: corrupt safetensors header: {exc}") from exc
        # ACCESS_COPY: private, writable pages (torch wants a writable buffer); disk never changes.
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    if mappings is not None:
        mappings.append(mapping)
    data_start = 8 + header_len
    for name, meta in header.items():
        if name == "__metadata__" or not name.startswith(prefix):
            continue
        if isinstance(meta, dict) and meta.get("dtype") not in SAFETENSORS_DTYPES:
            raise CheckpointError(
                f"{path}: tensor {name!r} has dtype {meta.get('dtype')!r}, which tandem does not "
                f"read (supported: {', '.join(SAFETENSORS_DTYPES)})"
            )
        try:
            dtype = SAFETENSORS_DTYPES[meta["dtype"]]
            begin, end = meta["data_offsets"]
            shape = tuple(meta["shape"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry") from exc
        count = 1
        for dim in shape:
            count *= dim
        if data_start + end > size or end - begin != count * dtype.itemsize:
            raise CheckpointError(
                f"{path}: tensor {name!r} lies outside the file; the file is truncated or corrupt"
            )
        if count == 0:
            yield name, torch.empty(shape, dtype=dtype)
            continue
        tensor = torch.frombuffer(mapping, dtype=dtype, count=count, offset=data_start + begin)
        yield name, tensor.view(shape)


class Checkpoint:
    """A folder's weights by name, as views of its memory-mapped safetensors files, or of its
    GGUF files (engine/gguf: quantized ones kept in their blocks). `prefix`
    (ModelConfig.weight_prefix): only the weights under it, named without it (a multimodal
    checkpoint's text model; the rest is never viewed). `quiet`: no progress on stderr (a
    parallel engine's other ranks)."""

    def __init__(self, folder: str, prefix: str = "", quiet: bool = False):
        self.weights: dict[str, torch.Tensor] = {}
        self._mappings: list[mmap.mmap] = []
        ggufs = gguf_folder.weight_files(folder)
        self.source = ggufs[0] if ggufs else folder  # what an error about a weight names
        if ggufs is not None:
            self.weights, readers = read_gguf(ggufs, quiet)
            self._mappings = [r.data._mmap for r in readers if getattr(r.data, "_mmap", None)]
            return
        for path in weight_files(folder):
            for name, tensor in read_safetensors(path, self._mappings, prefix):
                self.weights[name.removeprefix(prefix)] = tensor

    def drop_resident_pages(self) -> None:
        """Give the file pages read so far back to the OS, and the heap the load's temporaries
        freed. Call once weights that were copied (repacked, converted) are built: views still in
        use fault their pages back in from the file, and nothing is lost since the mapping was
        never written. (glibc keeps freed blocks below its mmap threshold in the heap: a
        quantized Kimi-shaped model kept 40% more than its weights resident without the trim.)"""
        for mapping in self._mappings:
            mapping.madvise(mmap.MADV_DONTNEED)
        try:
            ctypes.CDLL(None).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass


def load_weights(folder: str) -> dict[str, torch.Tensor]:
    return Checkpoint(folder).weights
