"""EAGLE-3: a one-layer head that drafts from the target's own hidden states.

The target hands over, for every token it verified, its hidden states at three layers (the
head's `aux_layers`: the inputs of those layers). The head fuses them (`fc`: 3 x hidden ->
hidden) and, at position i, combines that feature with the embedding of token i + 1 (the
target's own embedding table) to predict token i + 2. To draft further it feeds its own
output back as the next position's feature (training-time test unrolling teaches it to:
demo/train_eagle3.py). Its LM head covers a reduced vocabulary, mapped to the target's ids
by `d2t`.

The drafter keeps the head's paged KV (the engine's block manager and attention, at the
head's size) per request. Verified positions' hidden states wait until the request next
drafts, where one forward pass per draft position serves the whole batch: the first takes
every pending position (a new request's whole prompt, or the tokens kept last step) and
drafts one token, the others one token each. So a request the tuner keeps from drafting
(tuner.py: cap 0) costs the head nothing but keeping its states, fused down to the head's
width every FUSE_EVERY positions, and what the head's catch-up costs is charged to the steps
that draft, where the tuner sees it. Draft positions' KV is dropped after drafting; the
verified features replace it next time. Draft tokens are
the head's argmax, or draws from q that come with it (draw.py).

A request whose features start mid-sequence (a decode worker: the prompt ran elsewhere) is
drafted from the positions it has: RoPE is relative, so the head numbers its positions from
the first feature it saw.
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F

import engine.speculative.eagle3_published as eagle3_published
from engine.attention import create_backend
from engine.block_manager import BlockManager
from engine.checkpoint import Checkpoint
from engine.config import ModelConfig
from engine.errors import CheckpointError
from engine.kv_cache import KVCache
from engine.layers.linear import Linear
from engine.layers.norm import rms_norm
from engine.layers.rotary import RotaryEmbedding, apply_rotary
from engine.model_runner import ModelRunner
from engine.models.deepseek_v3 import LatentAttention
from engine.models.llama import WeightSource
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence
from engine.speculative.base import Draft, Drafter
from engine.speculative.draw import draw
from engine.speculative.eagle3_config import ARCHITECTURE, HeadConfig

GREEDY = SamplingParams(max_tokens=1 << 30, temperature=0)
FUSE_EVERY = 64  # raw hidden-state rows a request keeps before fusing them (a third of the memory)


def _is_own_head(folder: str) -> bool:
    try:
        with open(os.path.join(folder, "config.json")) as f:
            return json.load(f).get("architectures") == [ARCHITECTURE]
    except (OSError, ValueError):
        return False


def is_eagle3_head(folder: str) -> bool:
    """tandem's own head (demo/train_eagle3.py) or one in a published layout."""
    return _is_own_head(folder) or eagle3_published.architecture(folder) is not None


def load_head(
    folder: str, target: ModelConfig
) -> tuple[HeadConfig, dict[str, torch.Tensor], torch.Tensor | None]:
    """The head's config, its weights in this file's names, and its own embedding table (None:
    the target's), from tandem's layout or a published one."""
    if _is_own_head(folder):
        return HeadConfig.from_folder(folder), Checkpoint(folder).weights, None
    if eagle3_published.architecture(folder) is None:
        HeadConfig.from_folder(folder)  # raises: names what the folder is
    return eagle3_published.read(folder, target)


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """Low, middle and high (EAGLE-3 fuses three): for a deep target EAGLE-3's own choice, the
    inputs of layers 2, L/2 and L-3 (SmolLM2's 30: 2, 15, 27); for a shallow one (under 8
    layers: the demo's 4) the inputs of layers 1, L/2 and L-1."""
    if num_layers >= 8:
        return (2, num_layers // 2, num_layers - 3)
    return (min(1, num_layers - 1), num_layers // 2, max(num_layers - 1, 0))


class Eagle3Head:
    """The head's forward pass, on plain tensors (the engine's inference style). Its attention is
    a Llama layer's (q, k, v over [embedding, feature]) or, for a head in DeepSeek's layout,
    multi-head latent attention over the same input (the target's LatentAttention, absorbed)."""

    def __init__(
        self,
        cfg: HeadConfig,
        weights: dict[str, torch.Tensor],
        embed_tokens: torch.Tensor,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        attn,
    ):
        self.cfg = cfg
        h, hd = cfg.hidden_size, cfg.head_dim
        qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * hd
        shapes = {
            "fc.weight": (h, h * len(cfg.aux_layers)),
            "embed_norm.weight": (h,),
            "hidden_norm.weight": (h,),
            "post_attention_norm.weight": (h,),
            "gate_up_proj.weight": (2 * cfg.intermediate_size, h),
            "down_proj.weight": (h, cfg.intermediate_size),
            "norm.weight": (h,),
            "lm_head.weight": (cfg.draft_vocab_size, h),
            "d2t": (cfg.draft_vocab_size,),
            **({"fc_norm.weight": (len(cfg.aux_layers), h)} if cfg.fc_norm else {}),
            **(
                {}
                if cfg.mla
                else {
                    "qkv_proj.weight": (qkv_rows, 2 * h),
                    "o_proj.weight": (h, cfg.num_heads * hd),
                }
            ),
        }
        w = {}
        for name, shape in shapes.items():
            tensor = weights.get(name)
            if tensor is None or tuple(tensor.shape) != shape:
                found = None if tensor is None else tuple(tensor.shape)
                raise CheckpointError(
                    f"EAGLE-3 head: weight {name!r} has shape {found}, expected {shape}"
                )
            w[name] = tensor.to(device) if name == "d2t" else tensor.to(device=device, dtype=dtype)
        if embed_tokens.shape[1] != h:
            raise CheckpointError(
                f"EAGLE-3 head of hidden size {h} for a target of {embed_tokens.shape[1]}"
            )
        self.embed_tokens = embed_tokens
        self.fc = Linear(w["fc.weight"])
        self.fc_norm = w.get("fc_norm.weight")  # [aux layers, hidden]: one norm an aux state
        self.embed_norm, self.hidden_norm = w["embed_norm.weight"], w["hidden_norm.weight"]
        if cfg.mla:  # its weights checked and read as the target's layers read theirs
            self.latent = LatentAttention(
                cfg, WeightSource(weights, dtype, device), "self_attn.", attn, input_size=2 * h
            )
        else:
            self.latent, self.qkv_proj, self.o_proj = (
                None,
                Linear(w["qkv_proj.weight"]),
                Linear(w["o_proj.weight"]),
            )
        self.post_attention_norm, self.norm = w["post_attention_norm.weight"], w["norm.weight"]
        self.gate_up_proj, self.down_proj = (
            Linear(w["gate_up_proj.weight"]),
            Linear(w["down_proj.weight"]),
        )
        self.lm_head = Linear(w["lm_head.weight"])
        self.d2t = w["d2t"].long()
        rope_dim = cfg.mla.qk_rope_head_dim if cfg.mla else hd
        self.rope = RotaryEmbedding(
            rope_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype, device
        )
        self.attn = attn

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's hidden states at the aux layers [T, 3 x hidden] -> features [T, hidden]."""
        if self.fc_norm is not None:
            chunks = aux.chunk(len(self.fc_norm), dim=-1)
            aux = torch.cat(
                [rms_norm(c, w, self.cfg.rms_norm_eps) for c, w in zip(chunks, self.fc_norm)],
                dim=-1,
            )
        return self.fc(aux)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        features: torch.Tensor,
        kv_layer,
        attn_meta,
    ) -> torch.Tensor:
        """Row i: the feature of position i and the id of token i + 1. Returns the layer's output
        [T, hidden] (before the final norm; `fed_back` makes it the next position's feature)."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        normed = rms_norm(features, self.hidden_norm, eps)
        x = torch.cat(
            [rms_norm(F.embedding(input_ids, self.embed_tokens), self.embed_norm, eps), normed],
            dim=-1,
        )
        h = (normed if cfg.norm_before_residual else features) + self._attention(
            x, positions, kv_layer, attn_meta
        )
        gate, up = self.gate_up_proj(rms_norm(h, self.post_attention_norm, eps)).chunk(2, dim=-1)
        return h + self.down_proj(F.silu(gate) * up)

    def _attention(
        self, x: torch.Tensor, positions: torch.Tensor, kv_layer, attn_meta
    ) -> torch.Tensor:
        cos_sin = self.rope.lookup(positions)
        if self.latent is not None:
            return self.latent(x, cos_sin, kv_layer, attn_meta)
        cfg = self.cfg
        qkv = self.qkv_proj(x).view(x.shape[0], -1, cfg.head_dim)
        num_qk = cfg.num_heads + cfg.num_kv_heads
        qk = apply_rotary(qkv[:, :num_qk], cos_sin)
        o = self.attn.forward(
            qk[:, : cfg.num_heads], qk[:, cfg.num_heads :], qkv[:, num_qk:], kv_layer, attn_meta
        )
        return self.o_proj(o.reshape(o.shape[0], -1))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Next-token logits of each row of `out`, over the head's reduced vocabulary (`d2t`
        maps its ids to the target's)."""
        return self.lm_head(rms_norm(out, self.norm, self.cfg.rms_norm_eps))

    def fed_back(self, out: torch.Tensor) -> torch.Tensor:
        """The feature of the next draft position: the layer's output, or it normed (norm_output)."""
        return rms_norm(out, self.norm, self.cfg.rms_norm_eps) if self.cfg.norm_output else out


class _Request:
    """The head's view of one request: its paged sequence (position j holds token offset+j+1)
    and the features of the positions not yet run through the head, fused (`features`) then
    raw (`raw`: the target's hidden states, fused in one pass when needed). The last verified
    position is always pending, run again at each propose: its output drafts the first token."""

    def __init__(self, request_id: str, offset: int):
        self.seq = Sequence(request_id, [], GREEDY, seed=0)
        self.seq.token_ids = []
        self.offset = offset  # the target position of the head's position 0
        # [n, hidden] each, for positions from seq.num_computed_tokens
        self.features: list[torch.Tensor] = []
        self.raw: list[torch.Tensor] = []  # [n, 3 x hidden] each, for the positions after those
        self.num_raw = 0
        self.num_features = 0  # positions with a hidden state, run or pending


class Eagle3Drafter(Drafter):
    def __init__(
        self,
        folder: str,
        target: ModelConfig,
        embed_tokens: torch.Tensor,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        """`target`'s config and its embedding table (the head's, unless it brings its own) decide
        what the head must fit."""
        cfg, weights, own_embedding = load_head(folder, target)
        embed_tokens = embed_tokens if own_embedding is None else own_embedding
        if cfg.target_vocab_size != target.vocab_size or cfg.hidden_size != target.hidden_size:
            raise CheckpointError(
                f"EAGLE-3 head {folder} was trained for a target of vocabulary "
                f"{cfg.target_vocab_size} and hidden size {cfg.hidden_size}, not "
                f"{target.vocab_size} and {target.hidden_size}"
            )
        if (
            list(cfg.aux_layers) != sorted(cfg.aux_layers)
            or max(cfg.aux_layers) >= target.num_layers
        ):
            raise CheckpointError(
                f"EAGLE-3 head {folder} reads layers {cfg.aux_layers} (in order); the "
                f"target has {target.num_layers}"
            )
        self.cfg = cfg
        self.aux_layers = cfg.aux_layers
        self.feature_size = len(cfg.aux_layers) * cfg.hidden_size  # of one position's aux states
        backend = create_backend(
            "auto", **cfg.attention_shape(), block_size=block_size, device=device, dtype=dtype
        )
        self.head = Eagle3Head(
            cfg,
            weights,
            embed_tokens.to(device=device, dtype=dtype),
            dtype,
            device,
            max_model_len,
            backend,
        )
        self.kv_cache = KVCache(cfg, num_blocks, block_size, dtype, device)
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(self.head, self.kv_cache, backend, device)
        self._requests: dict[str, _Request] = {}

    def add_features(self, seq: Sequence, start: int, aux: torch.Tensor) -> None:
        """The target verified positions start.. of `seq` with these hidden states [n, 3 x hidden]."""
        req = self._requests.get(seq.request_id)
        if (
            req is None or start != req.offset + req.num_features
        ):  # new, or recomputed after a preemption
            self.forget(seq.request_id)
            req = self._requests[seq.request_id] = _Request(seq.request_id, start)
        # not a view keeping a step's states
        req.raw.append(aux if aux.shape[0] >= FUSE_EVERY else aux.clone())
        req.num_raw += aux.shape[0]
        req.num_features += aux.shape[0]
        if req.num_raw >= FUSE_EVERY:
            self._pending(req)

    def _pending(self, req: _Request) -> torch.Tensor:
        """All of `req`'s pending features [n, hidden], its raw states fused, kept as one tensor."""
        if req.raw:
            req.features.append(self.head.fuse(torch.cat(req.raw).to(self.head.embed_tokens.dtype)))
            req.raw, req.num_raw = [], 0
        if len(req.features) > 1:
            req.features = [torch.cat(req.features)]
        return req.features[0]

    def propose(self, seqs: list[Sequence], max_tokens: list[int]) -> list[Draft]:
        tokens_of: list[list[int]] = [[] for _ in seqs]
        draws_of: list[list] = [[] for _ in seqs]  # q of each drawn token (or None)
        live = []  # (index, request, k)
        for i, (seq, k) in enumerate(zip(seqs, max_tokens)):
            req = self._requests.get(seq.request_id)
            # Drafting needs a feature for every position up to the last verified one.
            if k > 0 and req is not None and req.offset + req.num_features == seq.num_tokens - 1:
                req.seq.token_ids = seq.token_ids[req.offset + 1 :]
                live.append((i, req, k))
        outs: dict[int, torch.Tensor] = {}  # index -> the head's output at its last position
        # ran: those the head's pool had room for (the others keep their features pending)
        drafting, ran = live, []
        for step in range(max((k for _, _, k in live), default=0)):
            batch, features, members = ScheduledBatch(), [], []
            for i, req, k in drafting:
                d = req.seq
                n = d.num_tokens - d.num_computed_tokens
                # A request stops drafting at its k, or where the head's pool has no room for it.
                if step >= k or not self.blocks.can_append(d, n):
                    continue
                self.blocks.append(d, n)
                batch.add(d, n)
                features.append(self._pending(req) if step == 0 else outs[i])
                members.append((i, req, k))
            if not members:
                break
            drafting = members
            ran = ran or members
            last = self._forward(batch, torch.cat(features))
            ids, qs = draw(
                self.head.logits(last),
                [seqs[i] for i, _, _ in members],
                [req.offset + 1 + req.seq.num_tokens for _, req, _ in members],
            )
            tokens, fed = self.head.d2t[ids].tolist(), self.head.fed_back(last)
            for row, ((i, req, _), n, token) in enumerate(
                zip(members, batch.num_new_tokens, tokens)
            ):
                req.seq.num_computed_tokens += n
                req.seq.token_ids.append(token)
                tokens_of[i].append(token)
                q = qs.get(row)
                draws_of[i].append(None if q is None else (self.head.d2t[q[0]], q[1]))
                outs[i] = fed[row : row + 1]
        for _, req, _ in ran:  # the drafts' KV goes; the target's verdict replaces it next step
            d = req.seq
            req.features = [req.features[0][-1:]]
            d.token_ids = d.token_ids[: req.num_features]
            d.num_computed_tokens = req.num_features - 1
            self.blocks.trim(d)
        return [Draft.from_draws(tokens, draws) for tokens, draws in zip(tokens_of, draws_of)]

    def _forward(self, batch: ScheduledBatch, features: torch.Tensor) -> torch.Tensor:
        """One pass of the head over `batch` (features in its row order); its output at each
        sequence's last row."""
        inputs = self.runner.prepare(batch)
        out = self.head.forward(
            inputs.input_ids, inputs.positions, features, self.kv_cache.pool[0], inputs.attn_meta
        )
        return out[inputs.sample_rows]

    def forget(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is not None:
            self.blocks.free(req.seq)
