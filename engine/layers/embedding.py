"""The token embedding and the LM head, whole or split by vocabulary across tensor-parallel
ranks: each rank holds vocab_size / ranks rows of each. A rank looks up only the ids in its
rows (zeros for the others) and the all-reduce completes every row; each rank's logits cover
its rows and an all-gather puts them side by side."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.layers.linear import Linear
from engine.layers.quantized.gguf import GgufWeight
from engine.parallel.group import all_gather, all_reduce


def lookup(table: torch.Tensor | GgufWeight, ids: torch.Tensor) -> torch.Tensor:
    """The rows `ids` of the table; a GGUF table's quantized rows dequantized (only those)."""
    if isinstance(table, GgufWeight):
        return table.rows(ids.to(table.device)).dequantize().to(ids.device)
    return F.embedding(ids, table)


class Embedding:
    def __init__(self, table: torch.Tensor | GgufWeight, first: int, vocab_size: int):
        """table: [rows, hidden], the vocabulary's rows first.. (all of them: first 0, rows vocab_size)."""
        self.table, self.first, self.split = table, first, table.shape[0] != vocab_size

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.split:
            return lookup(self.table, ids)
        local = ids - self.first
        inside = (local >= 0) & (local < self.table.shape[0])
        return all_reduce(
            lookup(self.table, local.clamp(0, self.table.shape[0] - 1)) * inside[:, None]
        )


class LMHead:
    def __init__(self, weight: torch.Tensor, vocab_size: int):
        self.linear, self.split = Linear(weight), weight.shape[0] != vocab_size

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        # Logits in fp32 whatever the model dtype: sampling and logprobs need the precision.
        logits = self.linear(hidden).float()
        return all_gather(logits) if self.split else logits
