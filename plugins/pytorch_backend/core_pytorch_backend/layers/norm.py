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
    residual protocol of RMSNorm: with ``residual``, ``(norm(x + residual), x + residual)``. Built with ``ops``
    whose set has a ``layer_norm`` (the native set's), that op instead: the native decode stack calls its kernel."""

    ops: Any = None  # the subclasses' (parameter-free) norms are torch's whatever the op set

    def __init__(self, hidden_size: int, eps: float, bias: bool = True, ops: Any = None):
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        native = getattr(self.ops, "layer_norm", None)
        if native is not None:
            return native(x, self.scale(), self.bias, self.eps, residual)
        if residual is not None:
            x = x + residual
            residual = x
        out = self.normalized(x)
        return out if residual is None else (out, residual)

    def scale(self) -> torch.Tensor:
        """What the normalized values are multiplied by (the native decode stack's norm weight)."""
        return self.weight

    def normalized(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.scale(), self.bias, self.eps)


class ParameterFreeLayerNorm(LayerNorm):
    """OLMo's LayerNorm: no weight or bias, computed in float32 and rounded to x's dtype once (as
    transformers' ``OlmoLayerNorm``)."""

    def __init__(self, eps: float = 1e-5):
        nn.Module.__init__(self)  # not LayerNorm's: no parameters
        self.eps = eps

    def normalized(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), (x.shape[-1],), None, None, self.eps).to(x.dtype)


def weightless_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x`` divided by its RMS over the last dimension, in float32 and rounded to x's dtype once (transformers'
    ``Llama4TextWeightlessRMSNorm``)."""
    y = x.float()
    return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


class WeightlessRMSNorm(LayerNorm):
    """An RMSNorm without a weight (NanoChat's every norm), with the residual protocol of RMSNorm. Built with
    ``rms_ops``, the op set's ``rms_norm`` of x in float32 with a weight of ones, rounded once (as GemmaRMSNorm's):
    the native decode stack's NORM_RMS_FLOAT of the same weight."""

    def __init__(self, eps: float, rms_ops: Any = None):
        nn.Module.__init__(self)  # not LayerNorm's: no parameters
        self.eps = eps
        self.rms_ops = rms_ops

    def normalized(self, x: torch.Tensor) -> torch.Tensor:
        if self.rms_ops is None:
            return weightless_rms_norm(x, self.eps)
        ones = torch.ones(x.shape[-1], dtype=torch.float32, device=x.device)
        return self.rms_ops.rms_norm(x.float(), ones, self.eps).to(x.dtype)
