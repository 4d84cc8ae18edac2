"""The ungated MLP of GPT-style decoders, ``down(act(up(x)))`` with biases, its two projections named as each
architecture's checkpoints name them (StarCoder 2: ``c_fc`` / ``c_proj``; GPT-NeoX: ``dense_h_to_4h`` /
``dense_4h_to_h``; Phi: ``fc1`` / ``fc2``), so that weights, quantization and LoRA targets find them by
those names."""

from __future__ import annotations

import torch
from torch import nn

from ..layers import Activation, Linear


class UngatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, names: tuple[str, str],
                 bias: bool = True):
        super().__init__()
        self.names = names
        setattr(self, names[0], Linear(hidden_size, intermediate_size, bias=bias))
        setattr(self, names[1], Linear(intermediate_size, hidden_size, bias=bias))
        self.act = Activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up, down = self.names
        return getattr(self, down)(self.act(getattr(self, up)(x)))
