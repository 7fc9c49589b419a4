"""A mixture of experts in place of the MLP: a router picks `top_k` of `num_experts` gated
MLPs per token, and the token's output is their outputs weighted by the routing weights (plus
shared experts that every token runs, where a family has them).

Llama 4 scales each chosen expert's input by its routing weight instead of its output
(`scale_inputs`); its top-1 routing makes that the token's row scaled once, the weight then 1.
gpt-oss's experts (engine/layers/mlp.py ClampedSwigluMLP) add a bias to each projection's output
and take their own activation, in the eager dispatch and the one op alike.

Routers (the model files choose):
- `softmax_topk`: softmax over every expert's logit (in fp32), the top k, optionally
  renormalised to sum to 1 (Qwen3-MoE's `norm_topk_prob`; Mixtral always).
- `grouped_sigmoid_topk` (DeepSeek-V3, Kimi-K2): sigmoid scores; a per-expert correction bias
  added for choosing only (the weights are the unbiased scores); the experts in groups, and
  only the `top_k_groups` groups with the best two-expert sums eligible; then top k,
  renormalised, times a scaling factor.
- `topk_softmax` (gpt-oss): the top k logits, softmaxed among themselves (in fp32).

Dispatch groups the tokens by expert: each expert that any token chose runs once, over its
tokens only, and its weighted outputs are added back into their rows. On the CPU's
batch-invariant kernels the experts' packed weights are stacked and the dispatch is one op
(engine/csrc/moe_experts.cpp, the same ops as the eager dispatch below). On CUDA the experts are
stacked and run by Triton's fused matmuls instead (engine/triton/fused_moe.py), which read
nothing back to the host, so CUDA graphs capture the layer. With expert
parallelism (engine/parallel/sharding.py) a rank holds only its own experts (the others are
None): it routes every token as usual, skips the others' experts, which is a routing weight
of zero for them here (the expert ids stay as routed), and the all-reduce adds the ranks'
sums.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.layers import fused
from engine.layers.linear import Linear, grouped_linear
from engine.layers.mlp import ClampedSwigluMLP, GatedMLP

# x [T, hidden] -> (weights, ids) [T, k]
Route = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def softmax_topk(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] fp32, expert ids [T, k])."""
    weights, ids = logits.float().softmax(dim=-1).topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_sigmoid_topk(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    num_groups: int,
    top_k_groups: int,
    renormalize: bool,
    scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (fp32) -> (weights [T, k] fp32, expert ids [T, k]), DeepSeek-V3's routing."""
    logits = logits.float()
    # A token's scores are its own on the CPU's op; eager torch's take another exp for the last
    # values of a tensor and where a thread's share ends, so its scores depended on its batch.
    scores = fused.OPS.sigmoid(logits.contiguous()) if fused.usable(logits) else logits.sigmoid()
    choice = scores + bias  # the bias steers the choice only
    num_tokens, num_experts = choice.shape
    if top_k_groups < num_groups:  # else every group is eligible (Kimi-K2: one group)
        grouped = choice.view(num_tokens, num_groups, num_experts // num_groups)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, groups]
        groups = group_scores.topk(top_k_groups, dim=-1, sorted=False).indices
        allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        choice = grouped.masked_fill(~allowed[:, :, None], float("-inf")).view(
            num_tokens, num_experts
        )
    ids = choice.topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling_factor, ids


def topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (the top k softmaxed among themselves [T, k] fp32, their ids [T, k])."""
    top, ids = logits.topk(top_k, dim=-1)
    return top.float().softmax(dim=-1), ids


def fused_experts(experts: list[GatedMLP | None]):
    """On CUDA, a layer's experts (all of them on this rank) stacked for Triton's fused matmuls
    (engine/triton/fused_moe.py), which read nothing back to the host; else None (and for
    experts with biases or another activation than SiLU)."""
    if any(type(e) is not GatedMLP for e in experts):
        return None
    weight = experts[0].down_proj.weight
    if weight is None or weight.device.type != "cuda":
        return None
    from engine.triton.fused_moe import FusedExperts

    return FusedExperts.of(experts)


class StackedExperts:
    """On the CPU's batch-invariant kernels, the held experts' packed gate/up and down weights
    stacked, a tensor each (their Linears keep views), for the one-op dispatch
    (engine/csrc/moe_experts.cpp); their biases stacked too, and gpt-oss's clamped SwiGLU named."""

    def __init__(self, experts: list[GatedMLP | None]):
        held = [e for e in experts if e is not None]
        self.gate_up, self.gate_up_scales = self._stack([e.gate_up_proj for e in held])
        self.down, self.down_scales = self._stack([e.down_proj for e in held])
        self.gate_up_bias = _stacked_biases([e.gate_up_bias for e in held])
        self.down_bias = _stacked_biases([e.down_bias for e in held])
        # SiLU: (0, 0)
        clamped = isinstance(held[0], ClampedSwigluMLP)
        self.swiglu = (held[0].alpha, held[0].limit) if clamped else (0.0, 0.0)
        slots, n = [], 0
        for e in experts:
            slots.append(-1 if e is None else n)
            n += e is not None
        self.slots = torch.tensor(slots, dtype=torch.long)
        self.gate_up_out = held[0].gate_up_proj.out_features
        self.down_out = held[0].down_proj.out_features

    @staticmethod
    def of(experts: list[GatedMLP | None]) -> StackedExperts | None:
        held = [e for e in experts if e is not None]
        linears = [lin for e in held for lin in (e.gate_up_proj, e.down_proj)]
        if (
            not held
            or not hasattr(fused.OPS, "moe_experts")
            or not all(lin.invariant_only for lin in linears)
            or len({type(e) for e in held}) != 1
            or len({(e.gate_up_bias is None, e.down_bias is None) for e in held}) != 1
        ):
            return None
        for proj in ("gate_up_proj", "down_proj"):
            forms = {
                (
                    lin.packed.shape,
                    lin.packed.dtype,
                    lin.out_features,
                    lin.quantized.get("scales") is None,
                )
                for lin in (getattr(e, proj) for e in held)
            }
            if len(forms) != 1:
                return None
        return StackedExperts(experts)

    @staticmethod
    def _stack(linears: list[Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each Linear's packed weight (and scales) copied into one stack, the Linear left with a
        view and its own copy let go at once (a layer's experts are never held twice)."""

        def stack(get, put) -> torch.Tensor:
            first = get(linears[0])
            stacked = torch.empty((len(linears), *first.shape), dtype=first.dtype)
            for i, lin in enumerate(linears):
                stacked[i].copy_(get(lin))
                put(lin, stacked[i])
            return stacked

        packed = stack(lambda lin: lin.packed, lambda lin, t: setattr(lin, "packed", t))
        if linears[0].quantized.get("scales") is None:
            return packed, None
        scales = stack(
            lambda lin: lin.quantized["scales"],
            lambda lin, t: lin.quantized.__setitem__("scales", t),
        )
        return packed, scales

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return fused.OPS.moe_experts(
            x if x.stride(-1) == 1 else x.contiguous(),
            ids,
            weights,
            self.gate_up,
            self.gate_up_scales,
            self.down,
            self.down_scales,
            self.slots,
            self.gate_up_out,
            self.down_out,
            self.gate_up_bias,
            self.down_bias,
            *self.swiglu,
        )


def _stacked_biases(biases: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if biases[0] is None else torch.stack(biases)


def _biased(y: torch.Tensor, biases: list[torch.Tensor | None], offsets: list[int]) -> torch.Tensor:
    """y's rows [offsets[g], offsets[g + 1]) plus biases[g], each (or y, where none has one)."""
    if biases[0] is None:
        return y
    counts = [b - a for a, b in zip(offsets, offsets[1:])]
    return y + torch.cat([bias.expand(n, -1) for bias, n in zip(biases, counts)])


class MoE:
    def __init__(
        self,
        route: Route,
        experts: list[GatedMLP | None],
        shared: GatedMLP | None = None,
        scale_inputs: bool = False,
    ):
        """`experts[e]` None: expert e lives on another rank (expert parallelism);
        `scale_inputs`: an expert's input is scaled by its routing weight, not its output."""
        self.route = route
        self.shared = shared  # every token's: added to the routed experts' sum
        self.scale_inputs = scale_inputs
        # Expert parallelism: which experts are this rank's (None: all are).
        held = torch.tensor([e is not None for e in experts])
        self.held = None if bool(held.all()) else held
        self.fused = fused_experts(experts)
        # The stacks hold the experts' weights from here on: their own copies are let go.
        self.experts = experts if self.fused is None else None
        self.stacked = StackedExperts.of(experts) if self.fused is None else None

    @property
    def capturable(self) -> bool:
        """A CUDA graph captures the fused experts; the dispatch below reads counts on the host."""
        return self.fused is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        routed_in = x
        if self.scale_inputs and ids.shape[1] == 1:  # top-1: the token's row, scaled once
            routed_in, weights = x * weights.to(x.dtype), torch.ones_like(weights)
        scaled_pairs = self.scale_inputs and ids.shape[1] > 1  # each pair's row scaled below
        if (self.fused is not None or self.stacked is not None) and not scaled_pairs:
            out = (self.fused or self.stacked)(routed_in, weights, ids)
            return out + self.shared(x) if self.shared is not None else out
        top_k = ids.shape[1]
        flat = ids.flatten()
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        if self.held is not None:
            order = order[self.held.to(flat.device)[flat[order]]]  # only this rank's experts' pairs
        # This rank's chosen experts in expert order, each over its run of `order`.
        chosen = [
            (self.experts[e], n) for e, n in enumerate(counts) if n and self.experts[e] is not None
        ]
        out = torch.zeros_like(x)
        if chosen:
            offsets = [0]
            for _, n in chosen:
                offsets.append(offsets[-1] + n)
            tokens = order // top_k
            pair_weights = weights.flatten()[order].to(x.dtype)[:, None]
            rows = routed_in[tokens] * pair_weights if scaled_pairs else routed_in[tokens]
            # All chosen experts' gate/up in one call, then all their down projections in another.
            experts = [e for e, _ in chosen]
            hidden = grouped_linear([e.gate_up_proj for e in experts], rows, offsets)
            hidden = _biased(hidden, [e.gate_up_bias for e in experts], offsets)
            routed = grouped_linear(
                [e.down_proj for e in experts], experts[0].activation(hidden), offsets
            )
            routed = _biased(routed, [e.down_bias for e in experts], offsets)
            # Each token's experts are added in expert order, as one index_add_ walks its rows.
            out.index_add_(0, tokens, routed if scaled_pairs else routed * pair_weights)
        return out + self.shared(x) if self.shared is not None else out


def linear_router(weight: torch.Tensor, top_k: int, renormalize: bool) -> Route:
    """Softmax top-k over logits in the model's dtype (Qwen3-MoE, Mixtral); a Linear, so a
    token's experts do not depend on its batch."""
    gate = Linear(weight)
    return lambda x: softmax_topk(gate(x), top_k, renormalize)
