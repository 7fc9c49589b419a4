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

# Ranks are stage * tensor_parallel + tensor-parallel rank; `tp_group` is this rank's stage's
# tensor-parallel ranks (None: the whole group, when there is one stage).
_HOST = "127.0.0.1"  # the ranks of an engine share its machine
_state = {"rank": 0, "world": 1, "tensor_parallel": 1, "tp_group": None}


def open_store(world: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store, where the group's ranks meet, on a port the OS picks as it binds (a port
    found free, closed and bound again later can be taken in between by another process)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore(_HOST, 0, world, is_master=True, timeout=timeout, wait_for_workers=False)


def store_at(port: int, world: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store, as ranks 1..N-1 reach it."""
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore(_HOST, port, world, is_master=False, timeout=timeout)


def init(
    rank: int,
    world: int,
    store: dist.Store,
    timeout_s: float,
    device: torch.device,
    tensor_parallel: int = 1,
) -> None:
    """Joins the engine's group of `world` ranks: world / tensor_parallel pipeline stages of
    `tensor_parallel` ranks each, every stage's ranks a subgroup of their own."""
    if dist.is_initialized():  # an earlier engine's group in this process
        destroy()
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=store,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    tp_group = None
    if 1 < tensor_parallel < world:  # every rank makes every subgroup, in the same order
        for stage in range(world // tensor_parallel):
            members = list(range(stage * tensor_parallel, (stage + 1) * tensor_parallel))
            subgroup = dist.new_group(members, timeout=datetime.timedelta(seconds=timeout_s))
            if rank in members:
                tp_group = subgroup
    _state.update(rank=rank, world=world, tensor_parallel=tensor_parallel, tp_group=tp_group)


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    _state.update(rank=0, world=1, tensor_parallel=1, tp_group=None)


def rank() -> int:
    return _state["rank"]


def world_size() -> int:
    return _state["world"]


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """The sum of every tensor-parallel rank's `t`, in place (a row-parallel layer's partial outputs)."""
    if _state["tensor_parallel"] > 1:
        dist.all_reduce(t, group=_state["tp_group"])
    return t


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    """The elementwise max of every tensor-parallel rank's `t`, in place (a row-parallel FP8
    layer's per-token amax over its ranks' column slices)."""
    if _state["tensor_parallel"] > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_state["tp_group"])
    return t


def all_gather(t: torch.Tensor) -> torch.Tensor:
    """Every tensor-parallel rank's `t`, side by side along the last dimension (vocab slices)."""
    parts = [torch.empty_like(t) for _ in range(_state["tensor_parallel"])]
    dist.all_gather(parts, t.contiguous(), group=_state["tp_group"])
    return torch.cat(parts, dim=-1)


def stage_peer(stage: int) -> int:
    """The rank of pipeline stage `stage` that holds this rank's tensor-parallel share."""
    return stage * _state["tensor_parallel"] + _state["rank"] % _state["tensor_parallel"]


def send(t: torch.Tensor, dst: int) -> None:
    """To the next pipeline stage (or the last stage's output back to rank 0)."""
    dist.send(t.contiguous(), dst)


def isend(t: torch.Tensor, dst: int):
    """`send`, returning at once: wait on the result before `t` is changed or dropped."""
    return dist.isend(t.contiguous(), dst)


def recv(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src: int
) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(t, src)
    return t


def broadcast(obj: Any = None) -> Any:
    """Rank 0's `obj` on every rank (the step plan, small Python objects and tensors)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(obj: Any) -> list | None:
    """Every rank's `obj`, in rank order, on rank 0 (None on the others)."""
    box = [None] * _state["world"] if _state["rank"] == 0 else None
    dist.gather_object(obj, box, dst=0)
    return box


def die_with_parent() -> None:
    """A rank process ends when the engine's process does, however it ends (Linux)."""
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
