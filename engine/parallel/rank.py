"""Ranks 1..N-1 of a tensor- and/or pipeline-parallel engine, each its own process (spawned,
never forked); rank = stage x tensor_parallel_size + its tensor-parallel rank.

Rank 0 is the engine itself (LLMEngine): it schedules, plans each step, and samples. Every
step it broadcasts the step's plan (model_runner.StepPlan: token ids, positions and the
attention batch ModelRunner.prepare made) and runs its own share of the forward pass; the
other ranks run theirs on the same plan. Between steps it may broadcast a KV command instead
(engine/parallel/kv_blocks.py: blocks in or out of the worker).

Tensor parallelism: the row-parallel layers' all-reduces meet in the middle (within the rank's
stage), and a rank's KV pool holds its own KV heads. Pipeline parallelism: each rank receives
the hidden states of its peer in the stage before and sends its own on, the last stage's go
back to the first stage (whose ranks compute the logits), and a rank's pool holds its own
layers; a long step goes through as micro-batches, so the stages overlap. Either way the
blocks are the ones rank 0 allocates. A rank that dies or hangs makes rank 0's next
collective fail within TIMEOUT_S (the engine then fails its requests); a rank ends with its
engine's process.
"""

from __future__ import annotations

import multiprocessing

import torch

from engine.config import EngineConfig
from engine.cpu import available_cpus
from engine.parallel import group

TIMEOUT_S = 60.0  # a collective that waits longer: a rank is gone


def threads_per_rank(config: EngineConfig) -> int:
    """Each rank's share of the engine's threads (`cpu_threads`, or every available CPU)."""
    return max(1, (config.cpu_threads or available_cpus()) // config.world_size)


def start_ranks(config: EngineConfig, device: torch.device) -> list[multiprocessing.Process]:
    """Starts ranks 1..N-1 and joins the group as rank 0 (returns once every rank has joined)."""
    world = config.world_size
    store = group.open_store(world, TIMEOUT_S)
    context = multiprocessing.get_context("spawn")
    threads = threads_per_rank(config)
    ranks = [
        context.Process(
            target=rank_main,
            args=(config, r, world, store.port, threads),
            daemon=True,
            name=f"tandem-rank-{r}",
        )
        for r in range(1, world)
    ]
    for process in ranks:
        process.start()
    torch.set_num_threads(threads)
    group.init(0, world, store, TIMEOUT_S, device, config.tensor_parallel_size)
    return ranks


def rank_main(config: EngineConfig, rank: int, world: int, store_port: int, threads: int) -> None:
    group.die_with_parent()
    torch.set_num_threads(threads)
    from engine.config import ModelConfig
    from engine.cpu import keep_freed_memory
    from engine.device import resolve_device, resolve_dtype
    from engine.kv_cache import KVCache
    from engine.model_runner import ModelRunner, StepPlan
    from engine.parallel import kv_blocks
    from engine.rank_model import RankLayout, load_rank_model

    mc = ModelConfig.from_folder(config.model)
    device = resolve_device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank)
    else:
        keep_freed_memory()
    dtype = resolve_dtype(config.dtype, mc, device)
    store = group.store_at(store_port, world, TIMEOUT_S)
    group.init(rank, world, store, TIMEOUT_S, device, config.tensor_parallel_size)
    layout = RankLayout.of(config, mc, rank)
    backend, model = load_rank_model(config, mc, layout, device, dtype)
    num_blocks = group.broadcast()
    group.gather(model.weight_bytes)
    kv_cache = KVCache(layout.kv_config, num_blocks, config.block_size, dtype, device)
    runner = ModelRunner(model, kv_cache, backend, device, world=world, stage=layout.stage)
    while (command := group.broadcast()) is not None:
        if isinstance(command, StepPlan):
            runner.run_plan(command)
        else:  # blocks in or out of the worker (engine/parallel/kv_blocks.py)
            kv_blocks.answer(command, kv_cache)
