"""RMSNorm computed in fp32, as Hugging Face's Llama-family models do."""

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    # Upcast for the statistics, multiply by the weight in the model's dtype (HF's order).
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)
