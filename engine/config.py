"""Model config (read from a checkpoint's config.json) and engine config (chosen by the user)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Literal

from engine.cpu import parse_cpu_list
from engine.errors import CheckpointError
from engine.gemma3_config import gemma3_text
from engine.gguf.folder import resolve_fields
from engine.gpt_oss_config import gpt_oss_text
from engine.llama4_config import IropeConfig, llama4_text

# Architectures the engine serves, by their model type; engine/models/ has a file per family.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Gemma3ForCausalLM": "gemma3",
    "GptOssForCausalLM": "gpt_oss",
    "Llama4ForCausalLM": "llama4",
}

# Multimodal wrappers served as their text model: (where its weights sit, its architecture).
# Kimi K2.5: text_config is DeepSeek-V3's (model_type kimi_k2); vision_tower.* and mm_projector.*
# are never read. Gemma 3: Gemma3ForCausalLM's weights under language_model. (as Google publishes
# them and transformers saves them); vision_tower.* and multi_modal_projector.* are never read.
# Llama 4 (Scout, Maverick): Llama4ForCausalLM's weights under language_model.; vision_model.*
# and multi_modal_projector.* are never read.
TEXT_INSIDE = {
    "KimiK25ForConditionalGeneration": ("language_model.", "DeepseekV3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("language_model.", "Gemma3ForCausalLM"),
    "Llama4ForConditionalGeneration": ("language_model.", "Llama4ForCausalLM"),
}

Role = Literal["prefill", "decode", "both"]


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling; `type` is 'default', 'linear', 'llama3' or 'yarn' (engine/layers/rotary.py)."""

    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn: the ramp between interpolated and kept frequencies, and the attention factors.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    # cos and sin scaled by it; None: from factor and the mscales
    attention_factor: float | None = None
    truncate: bool = True

    @property
    def softmax_mscale(self) -> float:
        """DeepSeek's yarn: the softmax scale is multiplied by this (mscale_all_dim's factor, squared)."""
        if self.type != "yarn" or not self.mscale_all_dim or self.factor <= 1:
            return 1.0
        return (0.1 * self.mscale_all_dim * math.log(self.factor) + 1.0) ** 2


@dataclass(frozen=True)
class MoeConfig:
    """A mixture of experts in place of the MLP (engine/layers/moe.py), in `sparse_layers`."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    renormalize: bool  # the top-k routing weights are scaled to sum to 1
    sparse_layers: tuple[int, ...]  # the others keep the dense MLP (intermediate_size)
    # DeepSeek-V3 / Kimi-K2: sigmoid scores, a selection-only bias, group-limited top-k, a
    # scaling factor and shared experts (num_groups 0: softmax top-k, none of these).
    num_groups: int = 0
    top_k_groups: int = 0
    scaling_factor: float = 1.0
    num_shared_experts: int = 0
    # Expert parallelism (engine/parallel/sharding.py): this rank's experts, [first, first +
    # count); None: every expert, each split across the tensor-parallel ranks.
    local_experts: tuple[int, int] | None = None
    # gpt-oss: the experts' clamped SwiGLU (engine/layers/mlp.py); limit 0: SiLU(gate) * up
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 0.0

    def is_local(self, expert: int) -> bool:
        return self.local_experts is None or self.local_experts[0] <= expert < sum(
            self.local_experts
        )

    @staticmethod
    def from_dict(raw: dict, model_type: str, num_layers: int) -> MoeConfig | None:
        if model_type == "deepseek_v3":  # the first first_k_dense_replace layers stay dense
            return MoeConfig(
                int(raw["n_routed_experts"]),
                int(raw["num_experts_per_tok"]),
                int(raw["moe_intermediate_size"]),
                bool(raw.get("norm_topk_prob", True)),
                tuple(range(int(raw.get("first_k_dense_replace", 0)), num_layers)),
                int(raw.get("n_group") or 1),
                int(raw.get("topk_group") or 1),
                float(raw.get("routed_scaling_factor", 1.0)),
                int(raw.get("n_shared_experts") or 0),
            )
        if model_type == "gpt_oss":  # every layer; a softmax over the top k logits
            return MoeConfig(
                int(raw["num_local_experts"]),
                int(raw["num_experts_per_tok"]),
                int(raw["intermediate_size"]),
                True,
                tuple(range(num_layers)),
                swiglu_limit=float(raw["swiglu_limit"]),
                swiglu_alpha=float(raw["swiglu_alpha"]),
            )
        if model_type == "mixtral":  # every layer; the top-k weights always renormalised
            return MoeConfig(
                int(raw["num_local_experts"]),
                int(raw["num_experts_per_tok"]),
                int(raw["intermediate_size"]),
                True,
                tuple(range(num_layers)),
            )
        if model_type == "llama4":  # sigmoid top-1, a shared expert; moe_layers (llama4_config.py)
            return MoeConfig(
                int(raw["num_local_experts"]),
                int(raw["num_experts_per_tok"]),
                int(raw["moe_intermediate_size"]),
                False,
                tuple(int(i) for i in raw["moe_layers"]),
                num_shared_experts=1,
            )
        if (
            model_type == "qwen3_moe"
        ):  # softmax top-k, optionally renormalised; some layers may stay dense
            num_experts = int(raw.get("num_experts") or raw["num_local_experts"])
            step, dense = (
                int(raw.get("decoder_sparse_step") or 1),
                set(raw.get("mlp_only_layers") or ()),
            )
            sparse = tuple(
                i
                for i in range(num_layers)
                if i not in dense and num_experts and (i + 1) % step == 0
            )
            return MoeConfig(
                num_experts,
                int(raw["num_experts_per_tok"]),
                int(raw["moe_intermediate_size"]),
                bool(raw.get("norm_topk_prob", False)),
                sparse,
            )
        return None


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): keys and values come from one
    compressed latent per token, which is what the KV cache holds (with the rope part)."""

    q_lora_rank: int | None  # None: a plain q projection
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the rope dimensions come in interleaved pairs

    @staticmethod
    def from_dict(raw: dict) -> MlaConfig:
        return MlaConfig(
            int(raw["q_lora_rank"]) if raw.get("q_lora_rank") else None,
            int(raw["kv_lora_rank"]),
            int(raw["qk_nope_head_dim"]),
            int(raw["qk_rope_head_dim"]),
            int(raw["v_head_dim"]),
            bool(raw.get("rope_interleave", True)),
        )

    @property
    def kv_layout(self) -> tuple[int, int, int]:
        """One entry a token: the latent and the rope part (V is the latent)."""
        return 1, 1, self.kv_lora_rank + self.qk_rope_head_dim

    def attention_shape(self, num_heads: int, softmax_mscale: float) -> dict:
        """Absorbed: every head attends over the one latent "head"."""
        return dict(
            num_heads=num_heads,
            num_kv_heads=1,
            head_dim=self.kv_lora_rank + self.qk_rope_head_dim,
            sliding_window=None,
            latent_v_dim=self.kv_lora_rank,
            scale=(self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5 * softmax_mscale,
        )


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2: q/k/v projections carry a bias
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None
    torch_dtype: str  # dtype the checkpoint was saved in
    eos_token_ids: tuple[int, ...] = ()
    moe: MoeConfig | None = None  # mixture-of-experts models
    mla: MlaConfig | None = None  # multi-head latent attention
    # a multimodal checkpoint's text weights sit under it (served text-only)
    weight_prefix: str = ""
    # Gemma 3: the layers that attend over sliding_window, with RoPE base local_rope_theta
    # (unscaled); the others attend over the whole context with rope_theta and rope_scaling.
    # None: every layer alike.
    sliding_layers: tuple[int, ...] | None = None
    local_rope_theta: float | None = None
    attention_scale: float | None = None  # the softmax scale; None: head_dim ** -0.5
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    irope: IropeConfig | None = None  # Llama 4's NoPE and chunked layers (llama4_config.py)
    # fbgemm_fp8: the bound on a token's amax as its activations are quantized to FP8
    activation_scale_ub: float | None = None

    @property
    def kv_layout(self) -> tuple[int, int, int]:
        """(entries, heads, head_dim) of one token's KV in the cache: K and V per KV head, or
        for MLA one entry of the latent and the rope part (V is the latent: no separate entry)."""
        if self.mla is not None:
            return self.mla.kv_layout
        return 2, self.num_kv_heads, self.head_dim

    def attention_shape(self) -> dict:
        """The attention backend's shape arguments (engine.attention.create_backend)."""
        if self.mla is None:
            shape = dict(
                num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim,
                sliding_window=self.sliding_window,
                sliding_layers=self.sliding_layers,
                scale=self.attention_scale,
                sinks=self.model_type == "gpt_oss",  # a sink logit a head joins each softmax
            )
            if self.irope is not None and self.irope.chunk_size:  # Llama 4's chunked layers
                shape.update(
                    sliding_layers=self.irope.chunked_layers, chunk_size=self.irope.chunk_size
                )
            return shape
        return self.mla.attention_shape(self.num_heads, self.rope_scaling.softmax_mscale)

    @staticmethod
    def from_folder(path: str) -> ModelConfig:
        config_path = os.path.join(path, "config.json")
        if not os.path.isfile(config_path):
            raise CheckpointError(f"{path}: no config.json; is this a Hugging Face model folder?")
        try:
            with open(config_path) as f:
                raw = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{config_path}: cannot parse: {exc}") from exc
        return ModelConfig.from_dict(raw, where=config_path)

    @staticmethod
    def from_dict(raw: dict, where: str = "config.json") -> ModelConfig:
        wrapper = next((a for a in raw.get("architectures") or [] if a in TEXT_INSIDE), None)
        if wrapper is not None:  # a multimodal checkpoint: its text model, served text-only
            text = dict(raw.get("text_config") or {})
            if not text:
                raise CheckpointError(f"{where}: {wrapper} without a text_config")
            if not text.get("architectures"):  # absent, or null as a saved sub-config writes it
                text["architectures"] = [TEXT_INSIDE[wrapper][1]]
            # Google's text_config leaves the dtype at the top; Meta's Llama 4 FP8 the quantization
            for key in ("torch_dtype", "dtype", "quantization_config"):
                if raw.get(key):
                    text.setdefault(key, raw[key])
            return dataclasses.replace(
                ModelConfig.from_dict(text, f"{where} (text_config)"),
                weight_prefix=TEXT_INSIDE[wrapper][0],
            )
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise CheckpointError(
                f"{where}: unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        model_type = SUPPORTED_ARCHITECTURES[arch]
        if model_type == "gemma3":
            raw = gemma3_text(raw, where)
        if model_type == "gpt_oss":
            raw = gpt_oss_text(raw, where)
        if model_type == "llama4":
            raw = llama4_text(raw)
        quantization = raw.get("quantization_config") or {}
        _check_quantization(quantization, where, model_type)
        try:
            num_heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            rope_params = raw.get("rope_parameters") or {}
            scaling = raw.get("rope_scaling") or rope_params
            sliding = raw.get("sliding_window")
            if model_type in ("qwen2", "qwen3", "qwen3_moe") and not raw.get(
                "use_sliding_window", False
            ):
                sliding = None  # Qwen configs carry a window they do not use
            eos = raw.get("eos_token_id")
            num_layers = int(raw["num_hidden_layers"])
            return ModelConfig(
                architecture=arch,
                model_type=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=num_layers,
                num_heads=num_heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
                head_dim=int(raw.get("head_dim") or hidden // num_heads),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(raw.get("rope_theta") or rope_params.get("rope_theta") or 10000.0),
                rope_scaling=_rope_scaling(
                    scaling, where, int(raw.get("max_position_embeddings", 2048))
                ),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
                qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3"),
                sliding_window=int(sliding) if sliding else None,
                torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
                eos_token_ids=_as_ids(eos),
                moe=MoeConfig.from_dict(raw, model_type, num_layers),
                mla=MlaConfig.from_dict(raw) if model_type == "deepseek_v3" else None,
                sliding_layers=_optional(tuple, raw.get("sliding_layers")),
                local_rope_theta=_optional(float, raw.get("local_rope_theta")),
                attention_scale=_optional(float, raw.get("attention_scale")),
                final_logit_softcapping=_optional(float, raw.get("final_logit_softcapping")),
                irope=IropeConfig.from_dict(raw) if model_type == "llama4" else None,
                activation_scale_ub=_optional(
                    float,
                    quantization.get("activation_scale_ub")
                    if quantization.get("quant_method") == "fbgemm_fp8"
                    else None,
                ),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{where}: missing or malformed field: {exc}") from exc


SUPPORTED_QUANTIZATION = (
    "fp8 (e4m3, weight_block_size [128, 128]); fbgemm_fp8 (FP8 weights per channel, "
    "activations per token); compressed-tensors pack-quantized (int weights of 4 bits, "
    "symmetric, in groups; activations unquantized); mxfp4 (gpt-oss's experts)"
)


def _check_quantization(config: dict | None, where: str, model_type: str) -> None:
    """The quantized formats read as published (engine/layers/quantized); anything else is named."""
    if not config:
        return
    method = config.get("quant_method")
    if method == "fp8":
        if (
            list(config.get("weight_block_size") or []) != [128, 128]
            or config.get("fmt", "e4m3") != "e4m3"
        ):
            raise CheckpointError(
                f"{where}: fp8 quantization with fmt {config.get('fmt')!r} and weight_block_size "
                f"{config.get('weight_block_size')!r} is not supported ({SUPPORTED_QUANTIZATION})"
            )
    elif method == "fbgemm_fp8":
        bound = config.get("activation_scale_ub")
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, (int, float))):
            raise CheckpointError(
                f"{where}: fbgemm_fp8 activation_scale_ub {bound!r} is not a number"
            )
    elif method == "mxfp4":
        if model_type != "gpt_oss":
            raise CheckpointError(
                f"{where}: mxfp4 quantization is read for gpt-oss's experts, not {model_type} "
                f"({SUPPORTED_QUANTIZATION})"
            )
    elif method == "compressed-tensors":
        if not config.get("config_groups"):
            raise CheckpointError(f"{where}: compressed-tensors quantization without config_groups")
        for name, group in config["config_groups"].items():
            fmt = group.get("format") or config.get("format")
            weights = group.get("weights") or {}
            scheme = {
                key: weights.get(key)
                for key in ("num_bits", "type", "symmetric", "strategy", "actorder")
            }
            if (
                fmt != "pack-quantized"
                or scheme
                != {**scheme, "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
                or weights.get("actorder") not in (None, "weight")
                or group.get("input_activations")
            ):
                raise CheckpointError(
                    f"{where}: compressed-tensors group {name!r} (format {fmt!r}, weights {scheme}, input_activations "
                    f"{group.get('input_activations')!r}) is not supported ({SUPPORTED_QUANTIZATION})"
                )
    else:
        raise CheckpointError(
            f"{where}: quantization {method!r} is not supported ({SUPPORTED_QUANTIZATION})"
        )


def _optional(kind, value):
    return None if value is None else kind(value)


def _as_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_scaling(raw: dict, where: str, max_positions: int) -> RopeScaling:
    kind = raw.get("rope_type") or raw.get("type") or "default"
    if kind == "default":
        return RopeScaling()
    if kind not in ("linear", "llama3", "yarn"):
        raise CheckpointError(
            f"{where}: unsupported rope scaling type {kind!r} (supported: linear, llama3, yarn)"
        )
    if kind == "yarn":  # as transformers reads it: factor defaults to max / original positions
        original = int(raw.get("original_max_position_embeddings") or max_positions)
        attention_factor = raw.get("attention_factor")
        return RopeScaling(
            type=kind,
            factor=float(raw.get("factor") or max_positions / original),
            original_max_position_embeddings=original,
            beta_fast=float(raw.get("beta_fast") or 32),
            beta_slow=float(raw.get("beta_slow") or 1),
            mscale=float(raw.get("mscale") or 0),
            mscale_all_dim=float(raw.get("mscale_all_dim") or 0),
            attention_factor=None if attention_factor is None else float(attention_factor),
            truncate=bool(raw.get("truncate", True)),
        )
    return RopeScaling(
        type=kind,
        factor=float(raw.get("factor", 1.0)),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
    )


@dataclass(frozen=True)
class EngineConfig:
    """What the user chooses. Values found at load time (number of KV blocks) live elsewhere."""

    model: str = field(
        metadata={
            "help": "a Hugging Face model folder (config.json, *.safetensors, tokenizer.json), a "
            "GGUF file (or a folder holding one), or an embedded model's name (smollm2, "
            "tandem-demo)",
            "env": "TANDEM_MODEL",
        }
    )
    dtype: str = field(
        default="auto",
        metadata={
            "help": "weights and KV dtype; auto: the checkpoint's (fp16 becomes fp32 on CPU)",
            "choices": ("auto", "float32", "bfloat16", "float16"),
        },
    )
    device: str = field(default="auto", metadata={"help": "auto: cuda when available, else cpu"})
    role: Role = "both"
    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    kv_cache_bytes: int | None = field(
        default=None,
        metadata={
            "help": "KV pool size in bytes; unset: --kv-cache-memory-fraction of free memory"
        },
    )
    kv_cache_memory_fraction: float = field(
        default=0.25, metadata={"help": "share of free memory for the KV pool"}
    )
    max_model_len: int | None = field(
        default=None,
        metadata={
            "help": "longest prompt + reply; unset: the checkpoint's max_position_embeddings"
        },
    )
    max_num_seqs: int = field(default=64, metadata={"help": "most sequences in one batch"})
    max_num_batched_tokens: int = field(
        default=512,
        metadata={
            "help": "token budget per step; longer prompts are chunked",
            "env": "TANDEM_MAX_NUM_BATCHED_TOKENS",
        },
    )
    wave_batched_tokens: int = field(
        default=2048,
        metadata={
            "help": "token budget of a step while more prompt tokens are left to compute than "
            "--max-num-batched-tokens takes (a wave of prompts: fewer, larger steps, so the last "
            "first token comes sooner, the running sequences' next tokens later); 0 or at most "
            "--max-num-batched-tokens: off",
            "env": "TANDEM_WAVE_BATCHED_TOKENS",
        },
    )
    cpu_threads: int = field(
        default=0,
        metadata={
            "help": "threads the engine computes on, split between its parallel ranks; 0: every CPU "
            "the process may use (a worker keeps --reserved-cpus of them for its front end)",
            "env": "TANDEM_CPU_THREADS",
        },
    )
    borrowed_cpus: str = field(
        default="",
        metadata={
            "help": "CPUs a step that fills --max-num-batched-tokens (a wave of prompts) also "
            "computes on, one thread each, e.g. '0' (engine/step_threads.py); the launcher lends "
            "a pinned worker its front end's CPU. Empty: none",
            "env": "TANDEM_BORROWED_CPUS",
        },
    )
    attention_backend: str = field(
        default="auto",
        metadata={
            "help": "attention kernels; auto: invariant on CPU (batch-invariant), flashinfer on CUDA "
            "when installed, else torch; triton: Triton's paged decode kernel (CUDA)",
            "choices": ("auto", "torch", "invariant", "flashinfer", "triton"),
        },
    )
    enforce_eager: bool = field(
        default=False,
        metadata={
            "help": "CUDA: run decode steps eagerly instead of replaying them from CUDA graphs"
        },
    )
    enable_prefix_caching: bool = field(
        default=True, metadata={"help": "reuse cached prompt prefixes"}
    )
    speculative: str = field(
        default="off",
        metadata={
            "help": "speculative decoding drafter (requests with a prediction draft from it either way)",
            "choices": ("off", "ngram", "draft", "eagle3"),
        },
    )
    draft_model: str | None = field(
        default=None,
        metadata={
            "help": "speculative 'draft': a small model folder with the target's tokenizer; 'eagle3': the "
            "EAGLE-3 head's folder"
        },
    )
    num_speculative_tokens: int = field(
        default=4,
        metadata={
            "help": "most draft tokens a request verifies per step (adapted down per request and batch size)"
        },
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata={
            "help": "processes that split every layer (heads, MLP, experts), gloo on CPU and NCCL on CUDA",
            "env": "TANDEM_TENSOR_PARALLEL_SIZE",
        },
    )
    pipeline_parallel_size: int = field(
        default=1,
        metadata={
            "help": "processes that each run a range of whole layers, passing hidden states on",
            "env": "TANDEM_PIPELINE_PARALLEL_SIZE",
        },
    )
    enable_expert_parallel: bool = field(
        default=False,
        metadata={
            "help": "with tensor parallelism: each rank holds whole experts (a share of them) instead of a "
            "slice of every expert",
            "env": "TANDEM_EXPERT_PARALLEL",
        },
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={
            "help": "load a tokenizer only the checkpoint's own Python reads "
            "(tokenizer_config.json's auto_map) through transformers, running that code "
            "(stop strings and structured outputs need the tokenizer)",
            "env": "TANDEM_TRUST_REMOTE_CODE",
        },
    )

    @property
    def world_size(self) -> int:
        """Processes of one engine: tensor x pipeline parallel ranks."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def __post_init__(self):
        resolve_fields(self, "model", "draft_model")  # a GGUF file or a model's name: its folder
        if self.role not in ("prefill", "decode", "both"):
            raise ValueError(f"role must be prefill, decode or both, not {self.role!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, not {self.block_size}")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError("max_num_batched_tokens must be at least block_size")
        if self.wave_batched_tokens < 0:
            raise ValueError("wave_batched_tokens must not be negative")
        if self.cpu_threads < 0:
            raise ValueError("cpu_threads must not be negative")
        if self.borrowed_cpus:
            parse_cpu_list(self.borrowed_cpus)  # a bad list is its error
        if self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be positive")
        if not 0 < self.kv_cache_memory_fraction < 1:
            raise ValueError("kv_cache_memory_fraction must be in (0, 1)")
        if self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must not be negative")
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError("tensor_parallel_size and pipeline_parallel_size must be at least 1")
        if self.pipeline_parallel_size > 1 and self.speculative == "eagle3":
            raise ValueError(
                "EAGLE-3 drafts from layers on several pipeline stages: not supported yet"
            )
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, not {self.dtype!r}"
            )
