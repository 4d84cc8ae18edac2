"""Gated activations of a merged [gate | up] projection: ``act(gate) * up``."""

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


class GeluTanhAndMul(nn.Module):
    """gelu(gate, approximate="tanh") * up of a merged [gate | up] projection (Gemma)."""

    def __init__(self, ops: Any):
        super().__init__()
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.gelu_tanh_and_mul(x)


# HF ``hidden_act`` / ``hidden_activation`` names (transformers' ACT2FN keys) -> layer class.
ACT_AND_MUL = {"silu": SiluAndMul, "swish": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}


def get_act_and_mul(hidden_act: str, ops: Any) -> nn.Module:
    """The gated activation for an HF activation name; NotImplementedError names the supported ones."""
    layer = ACT_AND_MUL.get(hidden_act)
    if layer is None:
        raise NotImplementedError(
            f"hidden_act {hidden_act!r} is not supported (supported: {', '.join(sorted(ACT_AND_MUL))})"
        )
    return layer(ops)
