"""RMSNorm and LayerNorms, with vLLM-style fused residual add."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ops: Any):
        super().__init__()
        self.ops = ops
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm(x)``; with ``residual``: ``(norm(x + residual), x + residual)``."""
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


class LayerNorm(nn.Module):
    """torch's LayerNorm (the call transformers' ``nn.LayerNorm`` makes, so the same values), with the
    residual protocol of RMSNorm: with ``residual``, ``(norm(x + residual), x + residual)``."""

    def __init__(self, hidden_size: int, eps: float, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
            residual = x
        out = F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
        return out if residual is None else (out, residual)


class ParameterFreeLayerNorm(nn.Module):
    """OLMo's LayerNorm: no weight or bias, computed in float32 and rounded to x's dtype once (as
    transformers' ``OlmoLayerNorm``), with the residual protocol of RMSNorm."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
            residual = x
        out = F.layer_norm(x.float(), (self.hidden_size,), None, None, self.eps).to(x.dtype)
        return out if residual is None else (out, residual)
