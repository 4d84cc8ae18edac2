"""Token embedding and LM head (optionally tied to the embedding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.lookup = F.embedding  # replaced when the table is kept quantized (layers.quantized.AffineRows)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lookup(input_ids, self.weight)


class LMHead(nn.Module):
    """Projects hidden states to float32 logits; ``tie_to`` shares the embedding's weight; ``bias``: a bias of
    its own (Phi's), tied or not."""

    def __init__(self, vocab_size: int, hidden_size: int, tie_to: VocabEmbedding | None = None, bias: bool = False):
        super().__init__()
        self.tied = tie_to is not None
        if tie_to is not None:
            self.weight = tie_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(vocab_size), requires_grad=False) if bias else None
        self.matmul = F.linear  # replaced per model by layers.matmul.use_matmul

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.matmul(hidden, self.weight, self.bias).float()
