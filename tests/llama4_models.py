"""Tiny random Llama 4 checkpoints in Meta's published layouts, with transformers' model on the
same weights as the reference (tests/golden/test_llama4_parity.py):

- "scout": Llama4ForConditionalGeneration, the text config nested beside a vision config, the
  text weights under language_model. beside vision_model.* and multi_modal_projector.*; 16
  experts, top-1, in every layer; NoPE every fourth layer; the RoPE layers chunked at 12 tokens
  (shorter than the prompts, and not a whole number of KV blocks); llama3 RoPE with Scout's
  factor 16 and equal frequency factors; L2 q/k norm; temperature tuning with a floor_scale of
  4, so it acts within a short prompt.
- "maverick": Llama4ForCausalLM, dense layers between MoE ones (interleave_moe_layer_step 2,
  dense intermediate_size_mlp apart from the experts' width), no q/k norm, chunks of 20; FP8 as
  FBGEMM publishes it (quant_method fbgemm_fp8): every Linear but the routers, lm_head and two
  layers' attention (modules_to_not_convert) FP8 per output channel with weight_scale, the
  experts' fused gate_up_proj and down_proj FP8 with their _scale, quantized exactly as
  transformers' FbgemmFp8Quantize does; activation_scale_ub 2, low enough that some tokens'
  activations are clamped. The reference is transformers' own FbgemmFp8Linear and
  FbgemmFp8Llama4TextExperts (integrations/fbgemm_fp8.py) with FBGEMM's two CUDA ops written out
  in torch as its kernels compute them (`register_fbgemm_ops`), in fp32.
"""

from __future__ import annotations

import functools
import json
import os

import torch
import transformers
from safetensors.torch import save_file

FP8_MAX = 448.0
ACTIVATION_SCALE_UB = 2.0

_TEXT = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=32,  # an expert's (and the shared expert's)
    intermediate_size_mlp=96,  # a dense layer's
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    initializer_range=0.1,  # peakier logits than the default: fewer near-ties in greedy tests
    floor_scale=4,
    attn_scale=0.5,
)
SCOUT = dict(
    _TEXT,
    num_local_experts=16,
    num_experts_per_tok=1,
    attention_chunk_size=12,
    use_qk_norm=True,
    rope_parameters=dict(
        rope_type="llama3",
        factor=16.0,
        low_freq_factor=1.0,
        high_freq_factor=1.0,
        original_max_position_embeddings=64,
        rope_theta=500000.0,
    ),
)
MAVERICK = dict(
    _TEXT,
    num_local_experts=8,
    num_experts_per_tok=1,
    interleave_moe_layer_step=2,
    attention_chunk_size=20,
    use_qk_norm=False,
    rope_parameters=dict(rope_type="default", rope_theta=500000.0),
)
_VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
    vision_output_dim=32,
    projector_input_dim=32,
    projector_output_dim=32,
)
# Maverick's kept dense, as its published list names modules (the routers and lm_head, and here
# two layers' attention)
NOT_CONVERTED = [
    "feed_forward.router",
    "lm_head",
    "model.layers.0.self_attn",
    "model.layers.1.self_attn",
]


def _randomised(model):
    """Random norms too (HF initialises them to 1), so a missed one shows."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model.eval()


def scout(folder: str):
    """Saves the Scout-like checkpoint in `folder`; returns the reference (its text model)."""
    torch.manual_seed(0)
    config = transformers.Llama4Config(text_config=SCOUT, vision_config=_VISION)
    model = _randomised(transformers.Llama4ForConditionalGeneration(config))
    model.save_pretrained(folder)
    # Llama4ForConditionalGeneration's own forward needs an image; its text model is the reference
    return model.language_model


def maverick(folder: str):
    """Saves the Maverick-like FP8 checkpoint in `folder`; returns the reference."""
    torch.manual_seed(0)
    config = transformers.Llama4TextConfig(**MAVERICK)
    config.architectures = ["Llama4ForCausalLM"]
    dense = _randomised(transformers.Llama4ForCausalLM(config))
    dense.save_pretrained(folder)
    weights = fbgemm_quantized(dense, NOT_CONVERTED)
    save_file(weights, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        saved = json.load(f)
    saved["quantization_config"] = {
        "quant_method": "fbgemm_fp8",
        "activation_scale_ub": ACTIVATION_SCALE_UB,
        "modules_to_not_convert": NOT_CONVERTED,
    }
    with open(path, "w") as f:
        json.dump(saved, f, indent=1)
    return fbgemm_reference(config, weights, NOT_CONVERTED)


def fp8_rows(x: torch.Tensor, scale_ub: torch.Tensor | None = None):
    """FBGEMM's quantize_fp8_per_row (quantize.cu): per row, s = max(min(amax, ub) / 448,
    1 / (448 * 512)), fp8(x / s) saturated; returns (the FP8 rows, s)."""
    x = x.float()
    amax = x.abs().amax(dim=-1)
    if scale_ub is not None:
        amax = torch.minimum(amax, scale_ub.float().reshape(()))
    scale = torch.clamp(amax / FP8_MAX, min=1.0 / (FP8_MAX * 512.0))
    q = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fbgemm_quantized(model, not_converted: list[str]) -> dict[str, torch.Tensor]:
    """The state dict as FbgemmFp8Quantize.convert writes it: a Linear's weight per row (its
    weight_scale [out, 1]); the experts' gate_up_proj [E, hidden, 2I] per column of each expert
    (gate_up_proj_scale [E, 1, 2I]) and down_proj [E, I, hidden] likewise ([E, hidden, 1])."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    out = {}
    for name, tensor in model.state_dict().items():
        module = name.rsplit(".", 1)[0]
        linear = isinstance(model.get_submodule(module), torch.nn.Linear)
        experts = name.endswith(("experts.gate_up_proj", "experts.down_proj"))
        if not (linear and name.endswith(".weight") or experts) or not should_convert_module(
            module if linear else name, not_converted
        ):
            out[name] = tensor.contiguous()
            continue
        if experts:
            rows = tensor.transpose(1, 2)  # [E, out, in]
            q, scale = fp8_rows(rows.reshape(-1, rows.shape[-1]))
            out[name] = q.reshape(rows.shape).transpose(1, 2).contiguous()
            shape = (
                (rows.shape[0], 1, rows.shape[1])
                if name.endswith("gate_up_proj")
                else (rows.shape[0], rows.shape[1], 1)
            )
            out[name + "_scale"] = scale.reshape(shape)
        else:
            out[name], scale = fp8_rows(tensor)
            out[name + "_scale"] = scale.reshape(-1, 1)
    return out


@functools.cache
def register_fbgemm_ops() -> None:
    """torch.ops.fbgemm's quantize_fp8_per_row and f8f8bf16_rowwise in plain torch, as the CUDA
    kernels compute them (the product summed in fp32, both scales applied to the sum; the output
    kept in fp32 here, where FBGEMM's is bf16, so the fp32 golden compares the math)."""
    lib = torch.library.Library("fbgemm", "FRAGMENT")
    lib.define(
        "quantize_fp8_per_row(Tensor input, Tensor? bs=None, Tensor? scale_ub=None) -> (Tensor, Tensor)"
    )
    lib.define(
        "f8f8bf16_rowwise(Tensor XQ, Tensor WQ, Tensor x_scale, Tensor w_scale, "
        "bool use_fast_accum=True) -> Tensor"
    )
    lib.impl("quantize_fp8_per_row", lambda x, bs=None, scale_ub=None: fp8_rows(x, scale_ub), "CPU")

    def rowwise(xq, wq, x_scale, w_scale, use_fast_accum=True):
        return (xq.float() @ wq.float().T) * x_scale.reshape(-1, 1) * w_scale.reshape(1, -1)

    lib.impl("f8f8bf16_rowwise", rowwise, "CPU")
    register_fbgemm_ops.lib = lib  # the registrations live as long as the library object


def fbgemm_reference(config, weights: dict[str, torch.Tensor], not_converted: list[str]):
    """transformers' Llama4ForCausalLM with its FBGEMM FP8 modules in place, as from_pretrained
    sets them up for a pre-quantized checkpoint, loaded with `weights`."""
    from transformers.integrations import fbgemm_fp8

    register_fbgemm_ops()
    model = transformers.Llama4ForCausalLM(config)
    fbgemm_fp8.replace_with_fbgemm_fp8_linear(
        model,
        modules_to_not_convert=not_converted,
        quantization_config=transformers.FbgemmFp8Config(ACTIVATION_SCALE_UB, not_converted),
        pre_quantized=True,
    )
    model.load_state_dict(weights, strict=True, assign=True)
    for module in model.modules():
        if hasattr(module, "input_scale_ub"):  # a buffer the quantizer fills after loading
            module.input_scale_ub = torch.tensor([ACTIVATION_SCALE_UB])
    return model.eval()
