"""Saved checkpoints rewritten as the seeds' family publishes its quantized ones, for the
golden tests (tests/tiny_models.py) and the Kimi-shaped bench checkpoints (bench/checkpoints.py):

- FP8 blocks (DeepSeek-V3, Kimi K2-Instruct): every matmul weight but the routers' and lm_head
  float8_e4m3fn with a float32 `weight_scale_inv` per 128 x 128 block (amax / 448).
- INT4 groups (Kimi K2-Thinking, K2.5): the routed experts' matmul weights quantized and packed
  by the compressed-tensors package itself (symmetric min-max, groups of 32, bf16 scales:
  `weight_packed`, `weight_scale`, `weight_shape`), everything else as it was.
- MXFP4 (gpt-oss): the experts' gate_up_proj and down_proj as OpenAI publishes them, `_blocks`
  of e2m1 nibbles and `_scales` of e8m0 exponents, everything else as it was.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable

import torch

FP8_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
# Kimi K2-Thinking's and K2.5's quantization_config: only the routed experts are INT4.
INT4_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "input_activations": None,
            "output_activations": None,
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": 32,
                "dynamic": False,
                "actorder": None,
                "observer": "minmax",
                "observer_kwargs": {},
                "block_structure": None,
            },
        }
    },
    "ignore": [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
    ],
    "kv_cache_scheme": None,
}

# gpt-oss's quantization_config: only the experts are MXFP4.
MXFP4_CONFIG = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}
FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # e2m1 by its low 3 bits; bit 3 the sign

# quantize(name, tensor) -> None (kept as is) or (stored tensors by name suffix, the dequantized tensor)
Quantizer = Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor] | None]


# Which weights each layout quantizes changed: a bench checkpoint written before is rewritten.
LAYOUT_REVISION = 2  # 2: FP8's kv_a_proj_with_mqa too, as DeepSeek-V3 publishes it


def fp8_blocks(name: str, tensor: torch.Tensor):
    if tensor.dim() != 2 or not name.endswith(
        ("_proj.weight", "_proj_with_mqa.weight")
    ):  # embeddings, norms, routers, lm_head
        return None
    out, cols = tensor.shape
    blocks = tensor.float().new_zeros(-(-out // 128), -(-cols // 128))
    for i in range(blocks.shape[0]):
        for j in range(blocks.shape[1]):
            block = tensor[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            blocks[i, j] = block.abs().max().float().clamp(min=1e-12) / 448.0
    scale = blocks.repeat_interleave(128, 0)[:out].repeat_interleave(128, 1)[:, :cols]
    quantized = (tensor.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return {"weight": quantized, "weight_scale_inv": blocks}, (quantized.float() * scale).to(
        tensor.dtype
    )


def int4_experts(name: str, tensor: torch.Tensor):
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    if ".mlp.experts." not in name or not name.endswith("_proj.weight"):
        return None
    args = QuantizationArgs(
        **{
            k: v
            for k, v in INT4_CONFIG["config_groups"]["group_0"]["weights"].items()
            if k not in ("observer", "observer_kwargs", "block_structure")
        }
    )
    groups = tensor.float().reshape(tensor.shape[0], -1, args.group_size)
    scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    scale = scale.to(torch.bfloat16)
    stored = PackedQuantizationCompressor.compress(
        {"weight": tensor.float(), "weight_scale": scale, "weight_zero_point": zero_point},
        QuantizationScheme(targets=["Linear"], weights=args),
    )
    values = unpack_from_int32(stored["weight_packed"], 4, tensor.shape)
    dequantized = values.float() * scale.float().repeat_interleave(args.group_size, 1)
    return stored, dequantized.to(tensor.dtype)


def rewrite(
    folder: str, quantize: Quantizer, quantization_config: dict, dequantized: str | None = None
) -> None:
    """Rewrites the saved folder's weights (every shard) with `quantize` and adds
    `quantization_config`. `dequantized`: also a copy of the folder with the same weights
    dequantized (a reference that computes with equal values)."""
    from safetensors.torch import load_file, save_file

    from engine.checkpoint import INDEX_FILE, weight_files

    if dequantized:
        shutil.copytree(folder, dequantized)
    renamed = {}
    for path in weight_files(folder):
        weights = load_file(path)
        reference = dict(weights)
        for name in list(weights):
            result = quantize(name, weights[name])
            if result is not None:
                stored, reference[name] = result
                del weights[name]
                renamed[name] = [name.removesuffix("weight") + suffix for suffix in stored]
                weights.update(zip(renamed[name], stored.values()))
        save_file(weights, path, metadata={"format": "pt"})
        if dequantized:
            save_file(
                reference,
                os.path.join(dequantized, os.path.basename(path)),
                metadata={"format": "pt"},
            )
    index_path = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            index = json.load(f)
        index["weight_map"] = {
            new: file
            for name, file in index["weight_map"].items()
            for new in renamed.get(name, [name])
        }
        with open(index_path, "w") as f:
            json.dump(index, f, indent=1)
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump({**config, "quantization_config": quantization_config}, f, indent=1)


def mxfp4_experts(name: str, tensor: torch.Tensor):
    """transformers' stacked experts [experts, in, out] (x @ W) as OpenAI publishes gpt-oss's:
    rows of outputs [experts, out, in], every 32 values along a row an e8m0 scale byte (2^(s -
    127), s - 127 = floor(log2(amax)) - 2, so the largest value falls in e2m1's [4, 8)) and 16
    bytes of e2m1 nibbles, each the nearest value, the low nibble first."""
    if not name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
        return None
    groups = tensor.float().transpose(-1, -2).unflatten(-1, (-1, 32))  # [experts, out, in / 32, 32]
    amax = groups.abs().amax(-1).clamp(min=2.0**-126)
    exponent = (torch.floor(torch.log2(amax)) - 2).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    magnitudes = torch.tensor(FP4_MAGNITUDES)
    nearest = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1)
    nibbles = (nearest | ((scaled < 0).long() << 3)).to(torch.uint8)
    blocks = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    values = magnitudes[nearest] * torch.where(scaled < 0, -1.0, 1.0)
    dequantized = (values * torch.exp2(exponent)[..., None]).flatten(-2).transpose(-1, -2)
    return {"_blocks": blocks, "_scales": (exponent + 127).to(torch.uint8)}, dequantized.to(
        tensor.dtype
    )
