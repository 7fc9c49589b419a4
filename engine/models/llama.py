"""The Llama-family decoder: Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm); the
mixture-of-experts families (qwen3_moe.py, mixtral.py) are this decoder with other MLPs.

Plain tensors rather than nn.Modules, run under inference mode only. Norms and embeddings
stay views of the memory-mapped checkpoint; matmul weights are fused (q/k/v, gate/up) and
prepared for their kernel once at load (engine/layers/linear.py). Input is one flat batch of
tokens from every scheduled sequence; attention goes through the paged KV pool via the backend.
"""

from __future__ import annotations

import dataclasses

import torch

from engine.attention.base import AttentionBackend
from engine.config import ModelConfig
from engine.errors import CheckpointError
from engine.layers.embedding import Embedding, LMHead
from engine.layers.linear import Linear
from engine.layers.mlp import GatedMLP
from engine.layers.norm import add_rms_norm, rms_norm
from engine.layers.quantized import QUANTIZED, Weight, cat_rows, dense, narrow
from engine.layers.quantized.fp8 import BLOCK as FP8_BLOCK
from engine.layers.quantized.fp8 import Fp8BlockWeight
from engine.layers.quantized.fp8_channel import Fp8ChannelWeight
from engine.layers.quantized.gguf import GgufWeight
from engine.layers.quantized.int4 import Int4GroupWeight
from engine.layers.rotary import RotaryEmbedding, apply_rotary
from engine.models.one_op_layer import one_op
from engine.parallel.group import all_reduce
from engine.parallel.sharding import stage_layers
from engine.progress import Stage


class WeightSource:
    """Hands out checkpoint tensors by name, checked and converted to the engine's dtype; with
    tensor parallelism (`shard` = (rank, ranks)), this rank's rows or columns of the split ones
    (engine/parallel/sharding.py), sliced from the memory-mapped tensor."""

    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        shard: tuple[int, int] = (0, 1),
        activation_scale_ub: float | None = None,
    ):
        """`activation_scale_ub`: FBGEMM FP8's bound on a token's amax (fp8_channel.py)."""
        self.weights = weights
        self.dtype = dtype
        self.device = device
        self.rank, self.ranks = shard
        self.activation_scale_ub = activation_scale_ub
        self.num_bytes = 0  # of the weights handed out: what this rank owns

    def get(self, name: str, shape: tuple[int, ...], split_dim: int | None = None) -> Weight:
        """The weight of `shape` (this rank's share of it where split along `split_dim`); a
        quantized matmul weight stays quantized (engine/layers/quantized)."""
        weight = self._read(name)
        whole = list(shape)
        if split_dim is not None:
            whole[split_dim] *= self.ranks
        if list(weight.shape) != whole:
            raise CheckpointError(
                f"weight {name!r} has shape {tuple(weight.shape)}, config implies {tuple(whole)}"
            )
        if split_dim is not None and self.ranks > 1:
            weight = narrow(weight, split_dim, self.rank * shape[split_dim], shape[split_dim])
        if isinstance(weight, QUANTIZED):
            self.num_bytes += weight.nbytes
            return weight.to(self.device)  # this rank's share alone goes to the device
        # A no-op (still the mmap view) when dtype and device already match.
        self.num_bytes += weight.numel() * self.dtype.itemsize
        return weight.to(device=self.device, dtype=self.dtype).contiguous()

    def has(self, name: str) -> bool:
        return name in self.weights or name + "_packed" in self.weights

    def _read(self, name: str) -> Weight:
        """The tensor `name` as stored, or the quantized weight stored in its place: FP8 blocks
        (`name` and `name`_scale_inv), FP8 channels (`name` and `name`_scale, FBGEMM's) or INT4
        groups (`name`_packed, _scale, _shape)."""
        tensor = self.weights.get(name)
        if tensor is None and name + "_packed" in self.weights:
            return Int4GroupWeight.from_checkpoint(
                name,
                self.weights[name + "_packed"],
                self.weights.get(name + "_scale", torch.empty(0)),
                self.weights.get(name + "_shape"),
                self.dtype,
            )
        if tensor is None:
            raise CheckpointError(f"checkpoint is missing weight {name!r}")
        if isinstance(tensor, GgufWeight):  # a GGUF file's blocks, computed in the model's dtype
            return dataclasses.replace(tensor, dtype=self.dtype)
        channel_scale = self.weights.get(name + "_scale")
        if channel_scale is not None and tensor.dtype == torch.float8_e4m3fn:
            if channel_scale.numel() != tensor.shape[0]:
                raise CheckpointError(
                    f"weight {name!r}: FP8 channel weights have one {name}_scale a row "
                    f"({tensor.shape[0]}), not {tuple(channel_scale.shape)}"
                )
            return Fp8ChannelWeight(
                tensor, channel_scale.float().flatten(), self.dtype, self.activation_scale_ub
            )
        scale_inv = self.weights.get(name + "_scale_inv")
        if scale_inv is None:
            return tensor
        blocks = tuple(-(-n // FP8_BLOCK) for n in tensor.shape)
        if tensor.dtype != torch.float8_e4m3fn or tuple(scale_inv.shape) != blocks:
            raise CheckpointError(
                f"weight {name!r}: FP8 block weights are float8_e4m3fn with a float32 "
                f"{name}_scale_inv of {blocks}, not {tensor.dtype} with {tuple(scale_inv.shape)}"
            )
        return Fp8BlockWeight(tensor, scale_inv.float(), self.dtype)

    def rows(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Column-parallel: this rank's output rows."""
        return self.get(name, shape, split_dim=0)

    def cols(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Row-parallel: this rank's input columns."""
        return self.get(name, shape, split_dim=1)

    def get_optional(
        self, name: str, shape: tuple[int, ...], split_dim: int | None = None
    ) -> torch.Tensor | None:
        return self.get(name, shape, split_dim) if self.has(name) else None


def dense_mlp(
    w: WeightSource,
    prefix: str,
    intermediate: int,
    hidden: int,
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    whole: bool = False,
) -> GatedMLP:
    """A gated MLP from `prefix` + its gate, up and down weights' names: this rank's slice of
    it, or with `whole` all of it (an expert that expert parallelism placed here)."""
    gate, up, down = (f"{prefix}{name}.weight" for name in names)
    rows, cols = (w.get, w.get) if whole else (w.rows, w.cols)
    return GatedMLP(
        rows(gate, (intermediate, hidden)),
        rows(up, (intermediate, hidden)),
        cols(down, (hidden, intermediate)),
    )


def experts(
    w: WeightSource,
    cfg: ModelConfig,
    prefix: str,
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
) -> list:
    """Every expert of a layer, `prefix` + its number: a slice of each, or with expert
    parallelism this rank's whole ones (None for the others')."""
    moe = cfg.moe
    return [
        dense_mlp(
            w,
            f"{prefix}{e}.",
            moe.intermediate_size,
            cfg.hidden_size,
            names,
            whole=moe.local_experts is not None,
        )
        if moe.is_local(e)
        else None
        for e in range(moe.num_experts)
    ]


def vocab_layers(cfg: ModelConfig, w: WeightSource) -> tuple[Embedding, LMHead]:
    """The token embedding and LM head: split by vocabulary across tensor-parallel ranks where
    the vocabulary divides (engine/layers/embedding.py), whole otherwise."""
    split = w.ranks > 1 and cfg.vocab_size % w.ranks == 0
    rows = (cfg.vocab_size // w.ranks if split else cfg.vocab_size, cfg.hidden_size)
    take = w.rows if split else w.get
    table = take("model.embed_tokens.weight", rows)
    if cfg.tie_word_embeddings:
        lm_head = table
    elif w.has("lm_head.weight"):
        lm_head = take("lm_head.weight", rows)
    else:
        raise CheckpointError(
            "checkpoint is missing weight 'lm_head.weight' (embeddings are not tied)"
        )
    return Embedding(table, w.rank * rows[0] if split else 0, cfg.vocab_size), LMHead(
        lm_head, cfg.vocab_size
    )


class DecoderLayer:
    def __init__(self, cfg: ModelConfig, w: WeightSource, i: int, attn: AttentionBackend, mlp):
        p = f"model.layers.{i}."
        hd, h, kvh, d = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size
        self.cfg = cfg
        self.attn = attn
        self.input_norm = w.get(p + "input_layernorm.weight", (d,))
        self.post_attn_norm = w.get(p + "post_attention_layernorm.weight", (d,))
        bias = w.get if cfg.attention_bias else w.get_optional
        qkv = [(name, n * hd) for name, n in (("q_proj", h), ("k_proj", kvh), ("v_proj", kvh))]
        qkv_biases = [bias(f"{p}self_attn.{name}.bias", (rows,), 0) for name, rows in qkv]
        # q/k/v and gate/up are fused into one matmul each: fewer, larger calls per step.
        self.qkv_proj = Linear(
            cat_rows([w.rows(f"{p}self_attn.{name}.weight", (rows, d)) for name, rows in qkv]),
            None if qkv_biases[0] is None else torch.cat(qkv_biases),
        )
        self.o_proj = Linear(w.cols(p + "self_attn.o_proj.weight", (d, h * hd)))
        # Qwen3's q and k norms as one [heads + kv_heads, head_dim] weight: one norm call for both.
        self.qk_norm = (
            torch.cat(
                [
                    w.get(p + "self_attn.q_norm.weight", (hd,)).expand(h, hd),
                    w.get(p + "self_attn.k_norm.weight", (hd,)).expand(kvh, hd),
                ]
            )
            if cfg.qk_norm
            else None
        )
        self.mlp = mlp  # a gated MLP, or a mixture of experts
        # the whole layer in one op of the CPU's, or None (a subclass has a forward of its own)
        self.one_op = one_op(self, w.ranks) if type(self) is DecoderLayer else None

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.cfg.rms_norm_eps)

    def attention(self, h: torch.Tensor, cos_sin, kv_layer, attn_meta) -> torch.Tensor:
        """h: the normed input [T, hidden] -> o_proj's output [T, hidden] (with tensor
        parallelism, this rank's partial sum)."""
        cfg = self.cfg
        # [T, heads + 2 * kv_heads, head_dim]: q and k heads are normed and rotated together.
        qkv = self.qkv_proj(h).view(h.shape[0], -1, cfg.head_dim)
        num_qk = cfg.num_heads + cfg.num_kv_heads
        qk, v = qkv[:, :num_qk], qkv[:, num_qk:]
        if self.qk_norm is not None:
            qk = self.norm(qk, self.qk_norm)
        qk = apply_rotary(qk, cos_sin)
        q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
        o = self.attn.forward(q, k, v, kv_layer, attn_meta)
        return self.o_proj(o.reshape(o.shape[0], -1))

    def forward(self, x: torch.Tensor, cos_sin, kv_layer, attn_meta) -> torch.Tensor:
        # x: [T, hidden]
        if self.one_op is not None:
            return self.one_op(x, cos_sin, kv_layer, attn_meta)
        h = self.norm(x, self.input_norm)
        # With tensor parallelism o_proj and the MLP are row-parallel: their partial sums add up.
        x, h = add_rms_norm(
            x,
            all_reduce(self.attention(h, cos_sin, kv_layer, attn_meta)),
            self.post_attn_norm,
            self.cfg.rms_norm_eps,
        )
        return x + all_reduce(self.mlp(h))


class LlamaModel:
    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        attn: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        max_positions: int,
        shard: tuple[int, int] = (0, 1),
        stage: tuple[int, int] = (0, 1),
    ):
        """`cfg`: this rank's view (engine/parallel/sharding.py); `shard`: (rank, ranks) of tensor
        parallelism; `stage`: (stage, stages) of pipeline parallelism: this rank's layers only,
        the embedding and LM head on the first stage, the final norm on the last."""
        w = WeightSource(weights, dtype, device, shard, cfg.activation_scale_ub)
        self.cfg = cfg
        self.layer_range = stage_layers(cfg, stage[1], stage[0])
        self.first_stage, self.last_stage = stage[0] == 0, stage[0] == stage[1] - 1
        self.embedding = self.lm_head = self.norm = None
        if self.first_stage:
            self.embedding, self.lm_head = vocab_layers(cfg, w)
        self._weights = w
        self.layers = []
        # Where pages are first read and weights repacked or widened: the load's long part. The
        # other ranks load beside rank 0 and stay quiet.
        with Stage(
            f"loading {cfg.architecture}",
            len(self.layer_range),
            "layers",
            quiet=shard[0] != 0 or stage[0] != 0,
        ) as progress:
            for i in self.layer_range:
                self.layers.append(self.make_layer(cfg, w, i, attn))
                progress.advance()
        if self.last_stage:
            self.norm = w.get("model.norm.weight", (cfg.hidden_size,))
        self.rope = self.make_rope(cfg, max_positions, dtype, device)
        # this rank's share of the checkpoint, in the engine's dtype
        self.weight_bytes = w.num_bytes

    def make_layer(self, cfg: ModelConfig, w: WeightSource, i: int, attn: AttentionBackend):
        """Layer i (its attention and MLP); DeepSeek-V3 overrides this with latent attention."""
        return DecoderLayer(cfg, w, i, attn.layer(i), self.make_mlp(cfg, w, i))

    def make_rope(self, cfg: ModelConfig, max_positions: int, dtype, device):
        """The RoPE tables `forward` looks every step's positions up in (Gemma 3: two)."""
        return RotaryEmbedding(
            self.rope_dim(cfg), max_positions, cfg.rope_theta, cfg.rope_scaling, dtype, device
        )

    @staticmethod
    def rope_dim(cfg: ModelConfig) -> int:
        """The dimensions RoPE rotates: a head's."""
        return cfg.head_dim

    def make_mlp(self, cfg: ModelConfig, w: WeightSource, i: int):
        """Layer i's MLP; the mixture-of-experts families override this."""
        return dense_mlp(w, f"model.layers.{i}.mlp.", cfg.intermediate_size, cfg.hidden_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_pool: torch.Tensor,
        attn_meta,
        aux_layers: tuple[int, ...] = (),
        aux_out: list | None = None,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T]; kv_pool: this rank's layers' [layers, blocks, 2, block_size,
        kv_heads, head_dim]; `hidden`: a later pipeline stage's input (the stage before's output).
        Returns the final hidden states [T, hidden] (normed; before the last stage, not). The
        inputs of `aux_layers` [T, hidden] go to `aux_out` (an EAGLE-3 head drafts from them)."""
        x = self.embed(input_ids) if hidden is None else hidden
        cos_sin = self.rope.lookup(positions)
        for j, (i, layer) in enumerate(zip(self.layer_range, self.layers)):
            if i in aux_layers:
                aux_out.extend(x for layer_id in aux_layers if layer_id == i)
            x = layer.forward(x, cos_sin, kv_pool[j], attn_meta)
        return self.final_norm(x) if self.last_stage else x

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> the first layer's input [T, hidden] (Gemma 3 scales it)."""
        return self.embedding(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [rows, vocab] (with a vocabulary split, every tensor-parallel rank calls this)."""
        return self.lm_head(hidden)

    @property
    def capturable(self) -> bool:
        """Whether a CUDA graph can capture `forward`: nothing in it reads a device value on the
        host (a mixture of experts dispatched on the host reads its experts' token counts)."""
        return all(
            getattr(getattr(layer, "mlp", None), "capturable", False) for layer in self.layers
        )

    @property
    def vocab_split(self) -> bool:
        return self.lm_head is not None and self.lm_head.split

    def embedding_table(self) -> torch.Tensor:
        """The whole token embedding [vocab, hidden] (an EAGLE-3 head embeds with it), read from
        the checkpoint where this rank holds a slice."""
        if not self.embedding.split:
            return dense(self.embedding.table)
        return self._weights.get(
            "model.embed_tokens.weight", (self.cfg.vocab_size, self.cfg.hidden_size)
        )
