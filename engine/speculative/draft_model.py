"""A classic draft model: a small checkpoint with the target's tokenizer proposes k tokens.

The draft keeps its own paged KV (the engine's block manager, pool and model runner, at its
own size) and a sequence per request that follows the target's. Each call it first catches
up: the tokens the target kept since the last call, its KV past the last token both agree
on dropped (drafts the target rejected); then it decodes greedily, all requests of the batch
in one forward pass per draft position. Greedy drafts are one-hot proposals (verify.py).

Any request the draft's pool cannot hold gets no draft (the target decodes it plainly).
"""

from __future__ import annotations

import torch

from engine.attention import create_backend
from engine.block_manager import BlockManager
from engine.checkpoint import Checkpoint
from engine.config import ModelConfig
from engine.errors import CheckpointError
from engine.kv_cache import KVCache, bytes_per_block
from engine.model_runner import ModelRunner
from engine.models import model_class
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from engine.speculative.base import Draft, Drafter
from engine.speculative.draw import draw

GREEDY = SamplingParams(max_tokens=1 << 30, temperature=0)


class DraftModelDrafter(Drafter):
    def __init__(
        self,
        folder: str,
        vocab_size: int,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        mc = ModelConfig.from_folder(folder)
        if mc.vocab_size != vocab_size:
            raise CheckpointError(
                f"draft model {folder}: vocabulary of {mc.vocab_size} tokens, the target's is "
                f"{vocab_size}; a draft needs the target's tokenizer"
            )
        backend = create_backend(
            "auto", **mc.attention_shape(), block_size=block_size, device=device, dtype=dtype
        )
        weights = Checkpoint(folder, mc.weight_prefix).weights
        model = model_class(mc.architecture)(mc, weights, backend, dtype, device, max_model_len)
        self.block_size = block_size
        self.kv_cache = KVCache(mc, num_blocks, block_size, dtype, device)
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(model, self.kv_cache, backend, device)
        self.kv_bytes = num_blocks * bytes_per_block(mc, block_size, dtype)
        self._seqs: dict[str, Sequence] = {}
        self._synced: dict[str, int] = {}  # tokens of the target's sequence at the last call

    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[Draft]:
        mine = [self._follow(seq) for seq in seqs]
        live = [(i, d, k) for i, (d, k) in enumerate(zip(mine, max_tokens)) if k > 0]
        lengths = {i: len(seqs[i].token_ids) for i, _, _ in live}
        # index -> q of each drawn token (or None)
        draws: dict[int, list] = {i: [] for i, _, _ in live}
        for step in range(max(k for _, _, k in live) if live else 0):
            batch, members = ScheduledBatch(), []
            for i, d, k in live:
                n = d.num_tokens - d.num_computed_tokens
                if step < k and self.blocks.can_append(d, n):
                    self.blocks.append(d, n)
                    batch.add(d, n)
                    members.append(i)
            if not batch:
                break
            inputs = self.runner.prepare(batch)
            tokens, qs = draw(
                self.runner.execute(inputs),
                [seqs[i] for i in members],
                [d.num_tokens for d in batch.seqs],
            )
            for row, (i, d, n, token) in enumerate(
                zip(members, batch.seqs, batch.num_new_tokens, tokens.tolist())
            ):
                d.num_computed_tokens += n
                d.token_ids.append(token)
                draws[i].append(qs.get(row))
        return [
            Draft.from_draws(d.token_ids[lengths[i] : lengths[i] + k], draws[i])
            if i in lengths
            else Draft()
            for i, (d, k) in enumerate(zip(mine, max_tokens))
        ]

    def _follow(self, seq: Sequence) -> Sequence:
        """The draft's sequence for `seq`, its tokens now the target's, its KV kept only where
        both agree."""
        d = self._seqs.get(seq.request_id)
        target = seq.token_ids
        if d is None:
            d = self._seqs[seq.request_id] = Sequence(seq.request_id, [], GREEDY, seed=0)
            d.token_ids = []
        synced = self._synced.get(seq.request_id, 0)  # these tokens are the target's, unchanged
        agree = synced
        while agree < min(len(d.token_ids), len(target)) and d.token_ids[agree] == target[agree]:
            agree += 1
        d.token_ids = list(target)
        d.num_computed_tokens = min(d.num_computed_tokens, agree, len(target) - 1)
        self.blocks.trim(d)
        self._synced[seq.request_id] = len(target)
        return d

    def forget(self, request_id: str) -> None:
        d = self._seqs.pop(request_id, None)
        self._synced.pop(request_id, None)
        if d is not None:
            self.blocks.free(d)
