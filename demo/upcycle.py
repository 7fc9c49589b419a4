"""The demo model as a mixture of experts: a Mixtral checkpoint "upcycled" from
`demo/tandem-demo` (each layer's MLP copied into every expert, as sparse upcycling starts),
for serving and testing the MoE paths (`make demo-moe`, then `make run MODEL=build/tandem-demo-moe TP=2`).

Mixtral is Llama attention with a softmax top-k router whose weights are renormalised, so
experts that were exact copies would reproduce the dense model token for token. Each expert
is the dense MLP plus seeded noise (NOISE of its weights' spread) instead, and the router is
seeded random: the experts differ, the routing matters (an expert placed on the wrong rank
shows), and the model still answers as the demo does. Deterministic: the same bytes on every
machine with the same torch.

    python demo/upcycle.py [--experts 4] [--top-k 2] [--out build/tandem-demo-moe]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DENSE = os.path.join(REPO_ROOT, "demo", "tandem-demo")
DEFAULT_OUT = os.path.join(REPO_ROOT, "build", "tandem-demo-moe")
NOISE = 0.02
COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def upcycle(
    out: str = DEFAULT_OUT, num_experts: int = 4, top_k: int = 2, dense: str = DENSE
) -> str:
    with open(os.path.join(dense, "config.json")) as f:
        config = json.load(f)
    config.update(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        num_local_experts=num_experts,
        num_experts_per_tok=top_k,
        sliding_window=None,
        router_aux_loss_coef=0.0,
        output_router_logits=False,
    )
    generator = torch.Generator().manual_seed(0)
    weights = {}
    for name, tensor in sorted(load_file(os.path.join(dense, "model.safetensors")).items()):
        if ".mlp." not in name:
            weights[name] = tensor
            continue
        layer, kind = name.split(".mlp.")  # model.layers.{i}, {gate,up,down}_proj.weight
        expert_name = {"gate_proj.weight": "w1", "up_proj.weight": "w3", "down_proj.weight": "w2"}[
            kind
        ]
        for e in range(num_experts):
            noise = torch.randn(tensor.shape, generator=generator) * tensor.std() * NOISE
            weights[f"{layer}.block_sparse_moe.experts.{e}.{expert_name}.weight"] = tensor + noise
        if kind == "gate_proj.weight":
            router = torch.randn((num_experts, config["hidden_size"]), generator=generator) * 0.02
            weights[f"{layer}.block_sparse_moe.gate.weight"] = router
    os.makedirs(out, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in weights.items()},
        os.path.join(out, "model.safetensors"),
        metadata={"format": "pt"},
    )
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    for name in COPIED:
        if os.path.isfile(os.path.join(dense, name)):
            shutil.copy(os.path.join(dense, name), os.path.join(out, name))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args()
    out = upcycle(args.out, args.experts, args.top_k)
    print(f"{out}: Mixtral, {args.experts} experts (top {args.top_k}) upcycled from {DENSE}")


if __name__ == "__main__":
    main()
