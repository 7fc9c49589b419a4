"""Turns a scheduled batch into one forward pass: flat token ids, positions, KV slots, logits."""

from __future__ import annotations

from dataclasses import dataclass

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
    input_ids: torch.Tensor | None  # [T] long (None: staged for a CUDA graph)
    positions: torch.Tensor | None  # [T] long
    attn_meta: object
    sample_rows: torch.Tensor  # [R] rows of the flat batch whose logits are sampled
    sample_seqs: list[Sequence]  # the sequences that finish their known tokens this step
    rows_per_seq: list[int]  # each one's rows among sample_rows: 1 + its draft tokens
    # each one's draft tokens (the rows after its first verify them)
    spec_token_ids: list[list[int]]
    aux_hidden: torch.Tensor | None = None  # [T, len(aux_layers) x hidden] after execute, if asked
    # what attn_meta was planned from (tensor-parallel ranks plan it too)
    attn_batch: AttentionBatch | None = None
    # staged for a CUDA graph instead (DecodeGraphs.stage)
    graph_step: tuple[int, int, int] | None = None


MICRO_BATCH_TOKENS = 128  # with pipeline stages, a step of at least this many tokens a stage splits


@dataclass
class StepPlan:
    """What the other ranks of a parallel engine need of a step: rank 0 broadcasts it."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_batch: AttentionBatch
    logit_rows: torch.Tensor | None  # the rows logits are computed for (None: every row)
    parts: int = 1  # micro-batches (every rank cuts them alike: `micro_batches`)


def micro_batches(plan: StepPlan) -> list[StepPlan]:
    """The step's tokens cut into `plan.parts` consecutive micro-batches of near-equal size. A
    sequence cut in two is chunked prefill within the step: each stage runs the parts in order,
    so its first part's KV is in the pool before its second part attends."""
    if plan.parts == 1:
        return [plan]
    batch, total = plan.attn_batch, plan.input_ids.shape[0]
    cuts = [round(total * k / plan.parts) for k in range(plan.parts + 1)]
    parts = []
    for lo, hi in zip(cuts, cuts[1:]):
        query_lens, context_lens, tables, start = [], [], [], 0
        for n, context, table in zip(batch.query_lens, batch.context_lens, batch.block_tables):
            first, last = max(lo, start), min(hi, start + n)  # this sequence's tokens in the part
            if first < last:
                query_lens.append(last - first)
                context_lens.append(context - (start + n - last))
                tables.append(table)
            start += n
        parts.append(
            StepPlan(
                plan.input_ids[lo:hi],
                plan.positions[lo:hi],
                AttentionBatch(query_lens, context_lens, tables, batch.slot_mapping[lo:hi]),
                None,
            )
        )
    return parts


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_cache: KVCache,
        backend: AttentionBackend,
        device: torch.device,
        world: int = 1,
        stage: tuple[int, int] = (0, 1),
        graphs: DecodeGraphs | None = None,
    ):
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
            # drafts ride after the last token (the scheduler gives them only to decodes)
            ids.extend(spec)
            positions.extend(range(start, start + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            context_lens.append(start + n)
            if (
                start + n - len(spec) == seq.num_tokens
            ):  # logits of the last token, and of each draft token
                sample_rows.extend(range(len(ids) - 1 - len(spec), len(ids)))
                sample_seqs.append(seq)
                rows_per_seq.append(1 + len(spec))
                sample_specs.append(spec)
        tables = [seq.block_table for seq in batch.seqs]
        if graphable and self.graphs is not None and self.graphs.fits(batch.num_new_tokens, tables):
            return StepInputs(
                input_ids=None,
                positions=None,
                attn_meta=None,
                sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=self.device),
                sample_seqs=sample_seqs,
                rows_per_seq=rows_per_seq,
                spec_token_ids=sample_specs,
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
    def execute(
        self, inputs: StepInputs, all_logits: bool = False, aux_layers: tuple[int, ...] = ()
    ) -> torch.Tensor:
        """Runs the forward pass; returns fp32 logits of the sampled rows [S, V] (or of every row).
        With `aux_layers`, every row's hidden states at those layers go to `inputs.aux_hidden`."""
        if inputs.graph_step is not None:  # prepare staged it only with no aux_layers asked
            logits = self.graphs.replay(inputs.graph_step)
            return logits if all_logits else logits[inputs.sample_rows]
        plan = StepPlan(
            inputs.input_ids,
            inputs.positions,
            inputs.attn_batch,
            None if all_logits else inputs.sample_rows,
        )
        if self.stages > 1 and inputs.input_ids.shape[0] >= MICRO_BATCH_TOKENS * self.stages:
            # stages overlap: the next one takes a part while this one goes on
            plan.parts = self.stages
        if self.world > 1:
            group.broadcast(plan)
        aux: list[torch.Tensor] = []
        if self.stages == 1:
            hidden = self.model.forward(
                inputs.input_ids,
                inputs.positions,
                self.kv_cache.pool,
                inputs.attn_meta,
                aux_layers,
                aux,
            )
        else:  # through the stages; the last one's output comes back here (EAGLE-3 refuses stages)
            hidden = self._pipeline(
                micro_batches(plan), [inputs.attn_meta] if plan.parts == 1 else None
            )
        if aux_layers:
            inputs.aux_hidden = torch.cat(aux, dim=-1)
        if not all_logits:
            hidden = hidden[inputs.sample_rows]
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def run_plan(self, plan: StepPlan) -> None:
        """A parallel rank's share of a step rank 0 planned (the logits are rank 0's)."""
        if self.stages == 1:
            out = self.model.forward(
                plan.input_ids,
                plan.positions,
                self.kv_cache.pool,
                self.backend.plan(plan.attn_batch),
            )
        else:
            out = self._pipeline(micro_batches(plan))
        if (
            out is not None and self.model.vocab_split
        ):  # this rank's vocabulary slice, gathered on every rank
            self.model.compute_logits(out if plan.logit_rows is None else out[plan.logit_rows])

    def _pipeline(self, parts: list[StepPlan], metas: list | None = None) -> torch.Tensor | None:
        """This rank's stage over a step's micro-batches in order, each sent on to the next stage
        as soon as it is done (the last stage's back to the first) while this one goes on with
        the next. On the first stage, returns the last stage's output for the whole step."""
        dtype, hidden_size = self.kv_cache.pool.dtype, self.model.cfg.hidden_size
        previous, following = (
            group.stage_peer(self.stage - 1),
            group.stage_peer((self.stage + 1) % self.stages),
        )
        sending = []
        for i, part in enumerate(parts):
            rows = part.input_ids.shape[0]
            hidden = (
                group.recv((rows, hidden_size), dtype, self.device, previous)
                if self.stage > 0
                else None
            )
            meta = metas[i] if metas else self.backend.plan(part.attn_batch)
            out = self.model.forward(
                part.input_ids, part.positions, self.kv_cache.pool, meta, hidden=hidden
            )
            # the tensor lives until its send is done
            sending.append((group.isend(out, following), out))
        outs = (
            [
                group.recv(
                    (p.input_ids.shape[0], hidden_size),
                    dtype,
                    self.device,
                    group.stage_peer(self.stages - 1),
                )
                for p in parts
            ]
            if self.stage == 0
            else None
        )
        for work, _ in sending:
            work.wait()
        return (
            torch.cat(outs) if outs is not None and len(outs) > 1 else (outs[0] if outs else None)
        )
