"""Turns a scheduled batch into one forward pass: flat token ids, positions, KV slots, logits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from engine.attention.base import AttentionBackend, AttentionBatch
from engine.cuda_graphs import DecodeGraphs
from engine.kv_cache import KVCache
from engine.models.llama import LlamaModel
from engine.parallel import group
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    attn_meta: object
    sample_rows: torch.Tensor  # [R] rows of the flat batch whose logits are sampled
    sample_seqs: list[Sequence]  # the sequences that finish their known tokens this step
    rows_per_seq: list[int]  # each one's rows among sample_rows: 1 + its draft tokens
    spec_token_ids: list[list[int]]  # each one's draft tokens (the rows after its first verify them)
    aux_hidden: Optional[torch.Tensor] = None  # [T, len(aux_layers) x hidden] after execute, if asked
    attn_batch: Optional[AttentionBatch] = None  # what attn_meta was planned from (tensor-parallel ranks plan it too)
    graph_step: Optional[tuple[int, int, int]] = None  # staged for a CUDA graph instead (then no tensors above)


@dataclass
class StepPlan:
    """What the other ranks of a parallel engine need of a step: rank 0 broadcasts it."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_batch: AttentionBatch
    logit_rows: Optional[torch.Tensor]  # the rows logits are computed for (None: every row)


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: KVCache, backend: AttentionBackend, device: torch.device,
                 world: int = 1, stage: tuple[int, int] = (0, 1), graphs: Optional[DecodeGraphs] = None):
        """`world` > 1: this runner is one of an engine's parallel ranks (engine/parallel/rank.py);
        rank 0's sends each step's plan to the others before the forward pass. `stage`: its
        pipeline stage, of how many. `graphs`: replays the decode steps that fit them."""
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = device
        self.block_size = kv_cache.block_size
        self.world = world
        self.stage, self.stages = stage
        self.graphs = graphs

    def prepare(self, batch: ScheduledBatch, graphable: bool = True) -> StepInputs:
        """The step's flat inputs; with `graphable` (no hidden states asked of it), a decode step
        that fits the CUDA graphs is staged for them instead."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        context_lens: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        rows_per_seq: list[int] = []
        sample_specs: list[list[int]] = []
        for seq, n, spec in zip(batch.seqs, batch.num_new_tokens, batch.spec_token_ids):
            start = seq.num_computed_tokens
            table = seq.block_table
            ids.extend(seq.token_ids[start : start + n - len(spec)])
            ids.extend(spec)  # drafts ride after the last token (the scheduler gives them only to decodes)
            positions.extend(range(start, start + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            context_lens.append(start + n)
            if start + n - len(spec) == seq.num_tokens:  # logits of the last token, and of each draft token
                sample_rows.extend(range(len(ids) - 1 - len(spec), len(ids)))
                sample_seqs.append(seq)
                rows_per_seq.append(1 + len(spec))
                sample_specs.append(spec)
        tables = [seq.block_table for seq in batch.seqs]
        if graphable and self.graphs is not None and self.graphs.fits(batch.num_new_tokens, tables):
            return StepInputs(
                input_ids=None, positions=None, attn_meta=None,
                sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=self.device),
                sample_seqs=sample_seqs, rows_per_seq=rows_per_seq, spec_token_ids=sample_specs,
                graph_step=self.graphs.stage(ids, positions, slots, context_lens, tables),
            )
        dev = self.device
        attn_batch = AttentionBatch(
            query_lens=batch.num_new_tokens,
            context_lens=context_lens,
            block_tables=tables,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
        )
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            attn_meta=self.backend.plan(attn_batch),
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=dev),
            sample_seqs=sample_seqs,
            rows_per_seq=rows_per_seq,
            spec_token_ids=sample_specs,
            attn_batch=attn_batch,
        )

    @torch.inference_mode()
    def execute(self, inputs: StepInputs, all_logits: bool = False, aux_layers: tuple[int, ...] = ()) -> torch.Tensor:
        """Runs the forward pass; returns fp32 logits of the sampled rows [S, V] (or of every row).
        With `aux_layers`, every row's hidden states at those layers go to `inputs.aux_hidden`."""
        if inputs.graph_step is not None:  # prepare staged it only with no aux_layers asked
            logits = self.graphs.replay(inputs.graph_step)
            return logits if all_logits else logits[inputs.sample_rows]
        if self.world > 1:
            group.broadcast(StepPlan(inputs.input_ids, inputs.positions, inputs.attn_batch,
                                     None if all_logits else inputs.sample_rows))
        aux: list[torch.Tensor] = []
        hidden = self.model.forward(inputs.input_ids, inputs.positions, self.kv_cache.pool, inputs.attn_meta,
                                    aux_layers, aux)
        if self.stages > 1:  # on through the other stages; the last one's output comes back here
            hidden = self._round_trip(hidden)
        if aux_layers:
            inputs.aux_hidden = torch.cat(aux, dim=-1)
        if not all_logits:
            hidden = hidden[inputs.sample_rows]
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def run_plan(self, plan) -> None:
        """A parallel rank's share of a step rank 0 planned (the logits are rank 0's)."""
        hidden = None
        if self.stage > 0:
            shape = (plan.input_ids.shape[0], self.model.cfg.hidden_size)
            hidden = group.recv(shape, self.kv_cache.pool.dtype, self.device, group.stage_peer(self.stage - 1))
        out = self.model.forward(plan.input_ids, plan.positions, self.kv_cache.pool,
                                 self.backend.plan(plan.attn_batch), hidden=hidden)
        if self.stage > 0:  # on to the next stage, or from the last back to the first
            group.send(out, group.stage_peer((self.stage + 1) % self.stages))
            return
        if self.stages > 1:
            out = self._round_trip(out)
        if self.model.vocab_split:  # this rank's vocabulary slice of the logits, gathered on every rank
            self.model.compute_logits(out if plan.logit_rows is None else out[plan.logit_rows])

    def _round_trip(self, hidden: torch.Tensor) -> torch.Tensor:
        """A first-stage rank's hidden states through the later stages: the last stage's output."""
        group.send(hidden, group.stage_peer(1))
        return group.recv(tuple(hidden.shape), hidden.dtype, hidden.device, group.stage_peer(self.stages - 1))
