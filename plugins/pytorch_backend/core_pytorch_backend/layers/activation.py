"""Gated activations of a merged [gate | up] projection, ``act(gate) * up``, and plain ones (``act(x)``)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """silu(gate) * up of a merged [gate | up] projection."""

    name = "silu"  # what MergedLinear.gated asks a weight's fused loop for

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


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's tanh GELU, written as transformers' ``NewGELUActivation`` writes it (the same values)."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _gelu_fast(x: torch.Tensor) -> torch.Tensor:
    """transformers' ``FastGELUActivation`` (gpt-neox-20b's ``gelu_fast``), written as it writes it."""
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def _bloom_gelu(x: torch.Tensor) -> torch.Tensor:
    """Bloom's tanh GELU as transformers writes it (``bloom_gelu_forward``: 0.79788456 for sqrt(2 / pi))."""
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


# HF ``hidden_act`` names -> the ungated activation, the same torch calls as transformers' ACT2FN ("bloom_gelu":
# Bloom's, which its config does not name).
ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu, "gelu_new": _gelu_new,
               "gelu_fast": _gelu_fast, "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "silu": F.silu,
               "swish": F.silu, "relu": F.relu, "relu2": lambda x: torch.square(F.relu(x)), "bloom_gelu": _bloom_gelu}


# the activations an op set may compute (its optional op of that name): the tanh GELUs (two spellings of one
# function) and relu^2
OP_OF = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "relu2": "relu2"}


class Activation(nn.Module):
    """An ungated activation (StarCoder 2's MLP: ``c_proj(act(c_fc(x)))``). Built with ``ops`` whose set has a
    ``gelu_tanh`` or ``relu2`` (the native set's), a tanh GELU or relu^2 is that op (``OP_OF``): the native decode
    stack calls its kernel."""

    def __init__(self, hidden_act: str, ops: Any = None):
        super().__init__()
        if hidden_act not in ACTIVATIONS:
            raise NotImplementedError(
                f"hidden_act {hidden_act!r} is not supported (supported: {', '.join(sorted(ACTIVATIONS))})")
        self.hidden_act = hidden_act
        self.op = getattr(ops, OP_OF[hidden_act], None) if hidden_act in OP_OF else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ACTIVATIONS[self.hidden_act](x) if self.op is None else self.op(x)


class ActAndMul(nn.Module):
    """act(gate) * up of a merged [gate | up] projection for the activations without an op of their own (GELU,
    ReLU, ...: ``ACTIVATIONS``), as transformers' gated MLPs take any ``ACT2FN`` name; the op set's fused calls
    and the native decode stack take silu and GELU-tanh alone, so these run as the plain torch calls."""

    def __init__(self, hidden_act: str):
        super().__init__()
        self.act = Activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return self.act(gate) * up


# HF ``hidden_act`` / ``hidden_activation`` names (transformers' ACT2FN keys) -> the layer class of an op of its own.
ACT_AND_MUL = {"silu": SiluAndMul, "swish": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}


def get_act_and_mul(hidden_act: str, ops: Any) -> nn.Module:
    """The gated activation for an HF activation name; NotImplementedError names the supported ones."""
    layer = ACT_AND_MUL.get(hidden_act)
    return layer(ops) if layer is not None else ActAndMul(hidden_act)


class XIELU(nn.Module):
    """xIELU (Apertus; arXiv 2411.13010), an activation with learned parameters, as transformers'
    ``XIELUActivation`` computes it: ``alpha_p * x^2 + beta * x`` for x > 0, else ``alpha_n * (expm1(min(x, eps))
    - x) + beta * x``, where ``alpha_p = softplus(alpha_p')`` and ``alpha_n = beta + softplus(alpha_n')`` of the
    stored ``alpha_p`` / ``alpha_n``. ``beta`` and ``eps`` are buffers checkpoints may or may not hold (the
    model's ``load_weights`` copies them in when they do). Built with ``ops`` whose set has an ``xielu`` (the
    native set's), that op of ``params()``: the native decode stack calls its kernel."""

    def __init__(self, beta: float = 0.5, eps: float = -1e-6, ops: Any = None):
        super().__init__()
        self.op = getattr(ops, "xielu", None)
        self.alpha_p = nn.Parameter(torch.zeros(1), requires_grad=False)
        self.alpha_n = nn.Parameter(torch.zeros(1), requires_grad=False)
        self.register_buffer("beta", torch.tensor(beta))
        self.register_buffer("eps", torch.tensor(eps))

    def params(self) -> tuple[float, float, float, float]:
        """(alpha_p, alpha_n, beta, eps) as the forward takes them (of the parameters' dtype)."""
        alpha_p, alpha_n = F.softplus(self.alpha_p), self.beta + F.softplus(self.alpha_n)
        return tuple(torch.cat([alpha_p, alpha_n, self.beta.reshape(1), self.eps.reshape(1)]).float().tolist())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.op is not None and x.dtype == self.alpha_p.dtype:
            return self.op(x, self.params())
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        return torch.where(x > 0, alpha_p * x * x + self.beta * x,
                           (torch.expm1(torch.min(x, self.eps)) - x) * alpha_n + self.beta * x)
