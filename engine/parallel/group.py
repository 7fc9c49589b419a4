"""This process's place in its engine's parallel group (rank 0: the engine; the others:
engine/parallel/rank.py), with the collectives the model and the step plan use: all-reduce
and all-gather across tensor-parallel ranks, send and receive between pipeline stages, and
the plan's broadcast. Without a group (one rank) the collectives are no-ops, so the model
code is the same either way."""

from __future__ import annotations

import ctypes
import datetime
import signal
from typing import Any

import torch
import torch.distributed as dist

_state = {"rank": 0, "world": 1, "tensor_parallel": 1}


def init(rank: int, world: int, init_method: str, timeout_s: float, device: torch.device,
         tensor_parallel: int = 1) -> None:
    """Joins the engine's group of `world` ranks; `tensor_parallel` of them split each layer
    (the whole group, for now: tensor and pipeline parallelism are not combined yet)."""
    if dist.is_initialized():  # an earlier engine's group in this process
        destroy()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    _state.update(rank=rank, world=world, tensor_parallel=tensor_parallel)


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    _state.update(rank=0, world=1, tensor_parallel=1)


def rank() -> int:
    return _state["rank"]


def world_size() -> int:
    return _state["world"]


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """The sum of every tensor-parallel rank's `t`, in place (a row-parallel layer's partial outputs)."""
    if _state["tensor_parallel"] > 1:
        dist.all_reduce(t)
    return t


def all_gather(t: torch.Tensor) -> torch.Tensor:
    """Every tensor-parallel rank's `t`, side by side along the last dimension (vocab slices)."""
    parts = [torch.empty_like(t) for _ in range(_state["tensor_parallel"])]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=-1)


def send(t: torch.Tensor, dst: int) -> None:
    """To the next pipeline stage (or the last stage's output back to rank 0)."""
    dist.send(t.contiguous(), dst)


def recv(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src: int) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(t, src)
    return t


def broadcast(obj: Any = None) -> Any:
    """Rank 0's `obj` on every rank (the step plan, small Python objects and tensors)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def die_with_parent() -> None:
    """A rank process ends when the engine's process does, however it ends (Linux)."""
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
