"""RMSNorm computed in fp32, as Hugging Face's Llama-family models do."""

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Written out rather than F.rms_norm: on CPU the fused op is ~7x slower for 512 rows.
    if x.dtype == torch.float32:
        return (x * torch.rsqrt((x * x).mean(-1, keepdim=True).add_(eps))).mul_(weight)
    # Upcast for the statistics, multiply by the weight in the model's dtype (HF's order).
    xf = x.float()
    return weight * (xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True).add_(eps))).to(x.dtype)
