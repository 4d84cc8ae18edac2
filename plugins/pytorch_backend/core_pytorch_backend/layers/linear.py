"""Linear layers, including merged projections that load HF's separate tensors shard by shard."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T (+ b); parameters start uninitialised: they are always loaded from a checkpoint."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None
        self.matmul = F.linear  # replaced per model by layers.matmul.use_matmul
        self.lora = None  # a lora.layers.LoraLayer where adapters target this layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.weight, self.bias)
        return y if self.lora is None else self.lora(x, y)


class MergedLinear(Linear):
    """Several projections of the same input stacked along the output dimension.

    ``shard_names`` name the pieces (e.g. ``("q", "k", "v")`` or ``("gate", "up")``) in output order.
    """

    def __init__(
        self, input_size: int, output_sizes: Sequence[int], shard_names: Sequence[str], bias: bool = False
    ):
        if len(output_sizes) != len(shard_names):
            raise ValueError("one shard name per output size")
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)
        self.shard_names = list(shard_names)
        # (x, bias, activation name) -> act(x @ W^T + bias), or None where it does not take the call
        self.gated_matmul: Callable[[torch.Tensor, torch.Tensor | None, str | None], torch.Tensor | None] | None = None

    def gated(self, x: torch.Tensor, act: nn.Module) -> torch.Tensor:
        """``act(self(x))`` for a [gate | up] projection and its gated activation (``act.name``): in one call
        where this layer's weight multiplies and applies it together (``gated_matmul``, set with the
        weight: a packed weight's prompt loop, silu), the same values; else the product, then ``act``."""
        if self.gated_matmul is not None and self.lora is None:
            out = self.gated_matmul(x, self.bias, getattr(act, "name", None))
            if out is not None:
                return out
        return act(self(x))

    def shard_slice(self, shard: str) -> slice:
        i = self.shard_names.index(shard)
        start = sum(self.output_sizes[:i])
        return slice(start, start + self.output_sizes[i])

    def load_shard(self, param_name: str, tensor: torch.Tensor, shard: str) -> None:
        param = getattr(self, param_name)
        _copy(param.data[self.shard_slice(shard)], tensor, f"{param_name}[{shard}]")

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        return list(y.split(self.output_sizes, dim=-1))


class QKVLinear(MergedLinear):
    """The fused q/k/v projection of grouped-query attention."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ):
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, sizes, ("q", "k", "v"), bias)


def _copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"shape mismatch loading {what}: checkpoint {tuple(src.shape)}, model {tuple(dst.shape)}"
        )
    dst.copy_(src)
