"""The communication a sharded model adds to its layers, attached after its weights are loaded.

The layers themselves stay the single-rank ones (whatever matmul, packed kernel or op set they run on):
a row-parallel linear gets a forward hook that all-reduces its partial output (its bias is rank 0's
alone, see slicing.py); a vocabulary-parallel embedding looks up only its own rows (others read zero)
and all-reduces; a vocabulary-parallel LM head gathers every rank's logits on rank 0, trimmed to the
vocabulary. Column-parallel layers need nothing: each rank's heads and MLP columns are its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from ..layers.embedding import LMHead, VocabEmbedding
from .group import RankGroups
from .plan import ROW, VOCAB, ShardLayout, kind_of


class VocabParallelLookup:
    """An embedding lookup of rows [start, start + count) of the vocabulary, all-reduced over the ranks."""

    def __init__(self, inner: Callable, layout: ShardLayout, groups: RankGroups) -> None:
        self.inner = inner
        self.start, self.count = layout.vocab_start, layout.vocab_per_rank
        self.groups = groups

    def __call__(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.count)
        rows = self.inner(local.masked_fill(outside, 0), weight)
        return self.groups.all_reduce(rows.masked_fill(outside.unsqueeze(-1), 0))


def parallelize(model: nn.Module, plan: Mapping[str, str], layout: ShardLayout, groups: RankGroups) -> int:
    """Attach the collectives of `plan` to a loaded shard; returns how many layers communicate."""
    count = 0
    for name, module in model.named_modules():
        kind = kind_of(f"{name}.weight", plan)
        if kind == ROW:
            module.register_forward_hook(_all_reduce_output(groups))
        elif kind == VOCAB and isinstance(module, VocabEmbedding):
            module.lookup = VocabParallelLookup(module.lookup, layout, groups)
        elif kind == VOCAB and isinstance(module, LMHead):
            module.register_forward_hook(_gather_logits(groups, layout.vocab_size))
        else:
            continue
        count += 1
    return count


def _all_reduce_output(groups: RankGroups) -> Callable:
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return groups.all_reduce(output)

    return hook


def _gather_logits(groups: RankGroups, vocab_size: int) -> Callable:
    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        gathered = groups.gather_last_dim(output)
        return output if gathered is None else gathered[..., :vocab_size]  # others' logits go unused

    return hook
