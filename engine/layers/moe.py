"""A mixture of experts in place of the MLP: a router picks `top_k` of `num_experts` gated
MLPs per token, and the token's output is their outputs weighted by the routing weights.

Routers (one per family; the model files choose):
- `softmax_topk`: softmax over every expert's logit (in fp32), the top k, optionally
  renormalised to sum to 1 (Qwen3-MoE's `norm_topk_prob`; Mixtral always).

Dispatch groups the tokens by expert: each expert that any token chose runs once, over its
tokens only, and its weighted outputs are added back into their rows. Expert parallelism
(issue 14, later) places experts on ranks behind the same contract: a rank computes its own
experts and masks the routing weights of the others (never the expert ids), so the sum is
unchanged.
"""

from __future__ import annotations

import torch

from engine.layers.linear import Linear
from engine.layers.mlp import GatedMLP


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] fp32, expert ids [T, k])."""
    weights, ids = logits.float().softmax(dim=-1).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class MoE:
    def __init__(self, router: torch.Tensor, experts: list[GatedMLP], top_k: int, renormalize: bool):
        """router: [num_experts, hidden] (the gate's weight); experts: one gated MLP each."""
        self.router = Linear(router)
        self.experts = experts
        self.top_k = top_k
        self.renormalize = renormalize

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = softmax_topk(self.router(x), self.top_k, self.renormalize)
        flat = ids.flatten()
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        tokens = order // self.top_k
        slot_weights = weights.flatten()[order].to(x.dtype)[:, None]
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                rows = tokens[start:start + count]
                out.index_add_(0, rows, self.experts[expert](x[rows]) * slot_weights[start:start + count])
                start += count
        return out
