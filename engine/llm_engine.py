"""LLMEngine: the engine's public face. Add requests, call `step()`, read outputs.

What services may use: `add` (an `AddRequest`), `step`, `abort`, `abort_all`,
`has_unfinished_requests`, `stats()`, `kv` (the KV connector, with its `layout`),
`attach_drafter`, `dead_ranks` and `close`; tests/unit/test_engine_api_boundary.py holds
services/ to that list. One thread drives an engine (the worker's engine loop); it is not
thread-safe.

Roles: `both` runs requests start to end; `prefill` stops after the first token, hands out a
copy of the prompt's KV with that output, and holds the blocks until `abort`; `decode`
admits requests whose KV was produced elsewhere (`kv.reserve`, then `add` with `FromPrefill`).
"""

from __future__ import annotations

import logging
import os
import secrets
import time

import torch

from engine.block_hash import hash_blocks, salt_root
from engine.block_manager import BlockManager
from engine.config import EngineConfig, ModelConfig
from engine.cpu import keep_freed_memory, parse_cpu_list
from engine.cuda_graphs import DecodeGraphs, decode_graphs_wanted
from engine.device import resolve_device, resolve_dtype
from engine.errors import CheckpointError, InvalidRequestError, RanksFailed
from engine.grammar import GrammarCompiler, valid_prefix
from engine.kv_cache import KVCache, num_blocks_for_budget
from engine.kv_connector import KVConnector, PoolConnector
from engine.model_runner import ModelRunner
from engine.outputs import Completion, EngineStats, RequestOutput
from engine.parallel import group
from engine.parallel.kv_blocks import ParallelKV
from engine.parallel.rank import start_ranks
from engine.rank_model import RankLayout, load_rank_model
from engine.requests import AddRequest, FromPrefill, FromStore
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.speculative import Draft, Drafter, Speculator, create_drafter
from engine.step_sampler import StepSampler
from engine.step_threads import StepThreads
from engine.stop_checker import StopChecker
from engine.tokenizer import Tokenizer, has_tokenizer

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, weights: dict[str, torch.Tensor] | None = None):
        """`weights`: tensors by checkpoint name in place of the folder's safetensors (one process;
        bench/gpu_check.py builds random ones on the device); the folder still gives the config."""
        t0 = time.perf_counter()
        self.config = config
        if weights is not None and config.world_size > 1:
            raise ValueError("weights given in memory serve one process, not parallel ranks")
        if not os.path.isdir(config.model):
            raise CheckpointError(f"{config.model}: not a directory")
        self.model_config = mc = ModelConfig.from_folder(config.model)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, mc, self.device)
        if self.device.type == "cpu":
            keep_freed_memory()
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's {mc.max_position_embeddings}"
            )
        remote = config.trust_remote_code
        self.tokenizer = (
            Tokenizer(config.model, remote) if has_tokenizer(config.model, remote) else None
        )
        self.eos_token_ids = set(mc.eos_token_ids) | set(
            self.tokenizer.eos_token_ids if self.tokenizer else ()
        )

        block_size, tp, pp = (
            config.block_size,
            config.tensor_parallel_size,
            config.pipeline_parallel_size,
        )
        # this rank's share (mc itself with one rank), checked first
        layout = RankLayout.of(config, mc, 0)
        if config.cpu_threads and config.world_size == 1:  # ranks split them (start_ranks)
            torch.set_num_threads(config.cpu_threads)
        self.step_threads = (
            StepThreads(
                config.cpu_threads or torch.get_num_threads(),
                parse_cpu_list(config.borrowed_cpus),
                config.max_num_batched_tokens,
            )
            if config.borrowed_cpus and config.world_size == 1 and self.device.type == "cpu"
            else None
        )
        # rank 0 is this process
        self.ranks = start_ranks(config, self.device) if config.world_size > 1 else []
        backend, self.model = load_rank_model(config, mc, layout, self.device, self.dtype, weights)
        num_blocks = num_blocks_for_budget(config, layout.kv_config, self.dtype, self.device)
        self.rank_weight_bytes = [self.model.weight_bytes]  # each rank's share of the weights
        if self.ranks:
            group.broadcast(num_blocks)  # every rank's pool has the same blocks
            self.rank_weight_bytes = group.gather(self.model.weight_bytes)
        use_graphs = decode_graphs_wanted(config, backend, self.model, self.device)
        # With decode graphs, one block more than the budget's: their scratch block, the pool's last.
        self.kv_cache = KVCache(
            layout.kv_config, num_blocks + use_graphs, block_size, self.dtype, self.device
        )
        graphs = (
            DecodeGraphs(
                self.model, self.kv_cache.pool, backend, config.max_num_seqs, self.max_model_len
            )
            if use_graphs
            else None
        )
        self.block_manager = BlockManager(num_blocks, block_size, config.enable_prefix_caching)
        self.runner = ModelRunner(
            self.model,
            self.kv_cache,
            backend,
            self.device,
            world=config.world_size,
            stage=layout.stage,
            graphs=graphs,
        )
        # Blocks in and out (export, import, the KV store) in one whole engine's layout; a
        # parallel engine's are gathered from and scattered to its ranks' pools.
        block_io = ParallelKV(mc, tp, pp, self.kv_cache) if self.ranks else self.kv_cache
        self.kv: KVConnector = PoolConnector(self.block_manager, self.kv_cache, block_io)
        self.speculator = Speculator(
            create_drafter(config.speculative, self, config.draft_model),
            config.num_speculative_tokens,
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.wave_batched_tokens,
            StopChecker(self.eos_token_ids, self.tokenizer, self.max_model_len),
            self.speculator,
            hold_prefilled=config.role == "prefill",
        )
        self._drafts: dict[str, Draft] = {}
        self._grammars: GrammarCompiler | None = None  # built on the first constrained request
        self.sampler = StepSampler(self.device, self._grammar_compiler)
        self.load_seconds = time.perf_counter() - t0
        log.info(
            "engine ready: %s (%s, %s, %d threads, %s attention%s) in %.2fs, %d KV blocks",
            mc.architecture,
            self.dtype,
            self.device,
            torch.get_num_threads(),
            type(backend).__name__,
            ", decode CUDA graphs" if graphs else "",
            self.load_seconds,
            num_blocks,
        )

    @property
    def seqs(self) -> dict[str, Sequence]:
        """Every request not yet finished or aborted, by id (the scheduler's)."""
        return self.scheduler.requests

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.block_manager.num_blocks

    def add(self, request: AddRequest) -> RequestOutput | None:
        """Admits a request, with its KV from where `request.kv` says. Raises InvalidRequestError
        when it cannot run; a reservation it came with is then given back (or, from the store,
        cached: other requests may use those blocks).

        Returns the first output of a request imported from a prefill worker (finished already
        if its first token ends it), else None: its outputs come from `step`."""
        kv = request.kv
        if kv is None:
            self.add_request(
                request.request_id, request.prompt_token_ids, request.params, request.cache_salt
            )
            return None
        if isinstance(kv, FromStore):
            self.kv.settle(kv.reservation)
            self.kv.cache(kv.reservation, kv.block_hashes)
            self.add_request(
                request.request_id, request.prompt_token_ids, request.params, request.cache_salt
            )
            return None
        try:
            self.kv.settle(kv.reservation)
            return self._import(request, kv)
        except Exception:
            self.kv.free(kv.reservation)
            raise

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str = "",
    ) -> None:
        """Queue a request whose whole prompt the engine computes (`add` without KV); its
        prefix is shared only with prompts of the same `cache_salt`. Raises
        InvalidRequestError (and changes nothing) when it cannot run."""
        self._validate(request_id, prompt_token_ids, params)
        seq = self._new_sequence(request_id, prompt_token_ids, params, cache_salt)
        self.scheduler.add(seq)

    def _import(self, request: AddRequest, kv: FromPrefill) -> RequestOutput:
        """Admits a sequence whose prompt KV was computed elsewhere; it joins the batch decoding.
        The decode side reports no cached tokens: the prefill side knows them."""
        prompt, blocks = request.prompt_token_ids, kv.reservation.blocks
        self._validate(request.request_id, prompt, request.params)
        if len(blocks) != -(-len(prompt) // self.config.block_size):
            raise InvalidRequestError(
                f"{len(blocks)} KV blocks do not hold a {len(prompt)}-token prompt"
            )
        if kv.block_hashes is not None and kv.block_hashes != hash_blocks(
            prompt, self.config.block_size, salt_root(request.cache_salt)
        ):
            raise InvalidRequestError(
                "the KV blocks' hashes do not match the prompt's tokens and cache salt"
            )
        seq = self._new_sequence(request.request_id, prompt, request.params, request.cache_salt)
        seq.block_table = list(blocks)
        seq.num_computed_tokens = len(prompt)
        self.block_manager.commit_full_blocks(seq)
        self.scheduler.add_running(seq)
        # Its logprobs are the prefill side's.
        return self._with_kv([self.scheduler.append_tokens(seq, [kv.first_token_id], None, [[]])])[
            0
        ]

    def _new_sequence(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str = "",
    ) -> Sequence:
        grammar = self._grammar_compiler().matcher(params.grammar) if params.grammar else None
        # Unseeded requests still get a fixed random stream of their own (see engine.sampler).
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        seq = Sequence(request_id, prompt_token_ids, params, seed, cache_salt)
        seq.grammar = grammar
        return seq

    def _grammar_compiler(self) -> GrammarCompiler:
        if self._grammars is None:
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "structured outputs need a tokenizer; this model folder has no tokenizer.json "
                    "or tiktoken.model"
                )
            self._grammars = GrammarCompiler(
                self.tokenizer, sorted(self.eos_token_ids), self.model_config.vocab_size
            )
        return self._grammars

    def _validate(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        if request_id in self.seqs:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if not prompt:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt if not (isinstance(t, int) and 0 <= t < vocab)), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad!r} is outside the vocabulary [0, {vocab})")
        if params.top_logprobs > vocab:
            raise InvalidRequestError(
                f"top_logprobs {params.top_logprobs} exceeds the vocabulary size {vocab}"
            )
        if len(prompt) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt)} tokens; the context is {self.max_model_len} tokens"
            )
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                f"of {self.max_model_len} tokens; at most {self.max_model_len - len(prompt)} new tokens fit"
            )
        # The last sampled token is never fed back, so it needs no KV.
        needed = -(-(len(prompt) + params.max_tokens - 1) // self.config.block_size)
        if needed > self.num_blocks:
            raise InvalidRequestError(
                f"the request needs {needed} KV blocks at full length; this worker's pool has {self.num_blocks}"
            )
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError(
                "stop strings need a tokenizer; this model folder has no tokenizer.json or "
                "tiktoken.model"
            )

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks at once (a prefilled one's, once its KV has moved).
        False if it was unknown or already done."""
        return self.scheduler.abort(request_id)

    def abort_all(self) -> None:
        for request_id in list(self.scheduler.requests):
            self.scheduler.abort(request_id)

    def attach_drafter(self, drafter: Drafter | None) -> None:
        """Speculates with `drafter` from the next step (a remote one: the draft service)."""
        self.speculator.drafter = drafter

    def dead_ranks(self) -> list[str]:
        """The names of a parallel engine's rank processes that have exited."""
        return [process.name for process in self.ranks if not process.is_alive()]

    def stats(self) -> EngineStats:
        scheduler = self.scheduler
        pending = decoding = 0
        for seq in (*scheduler.waiting, *scheduler.running):
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                pending += seq.num_prompt_tokens - seq.num_computed_tokens
            else:
                decoding += seq.num_tokens
        return EngineStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_blocks=self.num_blocks,
            num_free_blocks=self.num_free_blocks,
            num_preemptions=scheduler.num_preemptions,
            num_draft_tokens=self.speculator.num_drafted,
            num_accepted_draft_tokens=self.speculator.num_accepted,
            num_prompt_tokens_pending=pending,
            num_decode_tokens_running=decoding,
            max_model_len=self.max_model_len,
        )

    def close(self) -> None:
        """Ends a tensor-parallel engine's other ranks (they also end with this process)."""
        if self.ranks:
            group.broadcast(None)
            for process in self.ranks:
                process.join(timeout=10)
                if process.is_alive():
                    process.kill()
            self.ranks = []
            group.destroy()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass for the whole batch, sample (verifying any drafts), and
        let the scheduler book the outcome. A parallel engine's failed step raises RanksFailed."""
        if not self.ranks:
            return self._step()
        try:
            return self._step()
        except Exception as exc:  # a collective failed: a rank died or hung past the deadline
            raise RanksFailed(
                f"engine step failed across its tensor-parallel ranks: {exc}"
            ) from exc

    def _step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        batch = self.scheduler.schedule(self._propose_drafts())
        if not batch:
            return []
        decode_only = all(  # the tuners learn from steps of decodes alone
            n - len(spec) == 1 for n, spec in zip(batch.num_new_tokens, batch.spec_token_ids)
        )
        if self.step_threads is not None:  # drafts left out
            self.step_threads.fit(
                sum(batch.num_new_tokens) - sum(map(len, batch.spec_token_ids)),
                decode_batch=len(batch.seqs) if decode_only else 0,
            )
        drafter = self.speculator.drafter
        aux_layers = (
            drafter.aux_layers if drafter is not None and self.config.role != "prefill" else ()
        )
        inputs = self.runner.prepare(batch, graphable=not aux_layers)
        logits = self.runner.execute(inputs, aux_layers=aux_layers)
        starts = [seq.num_computed_tokens for seq in batch.seqs]
        sampled = self.sampler.sample_and_verify(inputs, logits, self._drafts)
        self._drafts = {}
        outputs = self._with_kv(self.scheduler.update_from_output(batch, sampled))
        if inputs.aux_hidden is not None:
            self._hand_features(batch, starts, inputs.aux_hidden)
        if decode_only:
            num_tokens, seconds = (
                sum(len(out.new_token_ids) for out in outputs),
                time.perf_counter() - started,
            )
            if self.speculator.cap is not None:  # the steps it capped
                self.speculator.record_step(len(batch.seqs), num_tokens, seconds)
            if self.step_threads is not None:
                self.step_threads.record(num_tokens, seconds)
        return outputs

    def _with_kv(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """A prefilled prompt's KV, copied out with its output in the step that finished it:
        fetching it later would wait a whole step on the engine thread, on every request's time
        to first token."""
        for out in outputs:
            if out.finish_reason == "prefilled":
                out.kv = self.kv.export(self.scheduler.requests[out.request_id])
        return outputs

    def _hand_features(self, batch, starts: list[int], aux_hidden: torch.Tensor) -> None:
        """Gives an EAGLE-3 drafter the target's hidden states at the positions this step
        verified: a prompt chunk's, a decode's last token and its kept drafts."""
        row = 0
        for seq, n, start in zip(batch.seqs, batch.num_new_tokens, starts):
            if seq.request_id in self.seqs:  # not finished
                self.speculator.drafter.add_features(
                    seq, start, aux_hidden[row : row + seq.num_computed_tokens - start]
                )
            row += n

    def _propose_drafts(self) -> dict[str, list[int]]:
        """Draft tokens for the decoding sequences that speculate this step, by request id."""
        if self.config.role == "prefill":
            return {}
        seqs, limits = [], []
        for seq in self.scheduler.running:
            if seq.num_computed_tokens == seq.num_tokens - 1:  # decoding, not mid-prompt
                # What it may still emit, less the token the step draws anyway.
                limit = (
                    min(
                        seq.params.max_tokens - seq.num_output_tokens,
                        self.max_model_len - seq.num_tokens,
                    )
                    - 1
                )
                if limit > 0:
                    seqs.append(seq)
                    limits.append(limit)
        self._drafts = self.speculator.propose(seqs, limits)
        for seq in seqs:  # a constrained request verifies only drafts its grammar accepts
            draft = self._drafts.get(seq.request_id)
            if draft is not None and seq.grammar is not None:
                draft.token_ids = valid_prefix(seq.grammar, draft.token_ids)
        return {
            request_id: draft.token_ids
            for request_id, draft in self._drafts.items()
            if draft.token_ids
        }

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[Completion]:
        """Run prompts to completion (a convenience for tests, benchmarks and scripts)."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{secrets.token_hex(6)}-{i}" for i in range(len(prompts))]
        for request_id, prompt, p in zip(ids, prompts, params_list):
            self.add_request(request_id, prompt, p)
        results: dict[str, Completion] = {
            rid: Completion(
                rid,
                [],
                [] if p.logprobs else None,
                None,
                len(prompt),
                0,
                [] if p.top_logprobs else None,
            )
            for rid, prompt, p in zip(ids, prompts, params_list)
        }
        pending = set(ids)
        while pending:
            for out in self.step():
                done = results.get(out.request_id)
                if done is None:
                    continue
                done.token_ids += out.new_token_ids
                if out.new_logprobs is not None:
                    done.logprobs += out.new_logprobs
                if out.new_top_logprobs is not None:
                    done.top_logprobs += out.new_top_logprobs
                done.num_cached_tokens = out.num_cached_tokens
                if out.finished:
                    done.finish_reason = out.finish_reason
                    pending.discard(out.request_id)
        return [results[rid] for rid in ids]
