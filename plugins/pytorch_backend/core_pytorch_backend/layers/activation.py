"""Gated activations."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class SiluAndMul(nn.Module):
    """silu(gate) * up of a merged [gate | up] projection."""

    def __init__(self, ops: Any):
        super().__init__()
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(x)


def get_act_and_mul(hidden_act: str, ops: Any) -> nn.Module:
    if hidden_act not in ("silu", "swish"):
        raise NotImplementedError(f"hidden_act {hidden_act!r} is not supported (supported: silu)")
    return SiluAndMul(ops)
