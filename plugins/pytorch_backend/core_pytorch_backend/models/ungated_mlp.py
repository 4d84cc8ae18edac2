"""The ungated MLP of GPT-style decoders, ``down(act(up(x)))`` with biases, its two projections named as each
architecture's checkpoints name them (StarCoder 2: ``c_fc`` / ``c_proj``; GPT-NeoX: ``dense_h_to_4h`` /
``dense_4h_to_h``; Phi: ``fc1`` / ``fc2``), so that weights, quantization and LoRA targets find them by
those names."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..layers import Activation, Linear


class UngatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, names: tuple[str, str],
                 bias: bool = True, ops: Any = None):
        super().__init__()
        self.names = names
        setattr(self, names[0], Linear(hidden_size, intermediate_size, bias=bias))
        setattr(self, names[1], Linear(intermediate_size, hidden_size, bias=bias))
        self.act = Activation(hidden_act, ops)  # with ops: the op set's tanh GELU (the native decode stack's)

    def projections(self) -> tuple[nn.Module, nn.Module]:
        """(up, down) under the architecture's names."""
        return getattr(self, self.names[0]), getattr(self, self.names[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, down = self.projections()
        return down(self.act(up(x)))
