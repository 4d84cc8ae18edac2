"""Gemma 4's layer parts beside attention (models/gemma4.py), following transformers' ``modeling_gemma4``:

- its RMSNorm, ``norm(x) * weight`` (not Gemma 3's ``1 + weight``) in float32, rounded to x's dtype once,
  and the weightless norm of its values and its router's input;
- the MLPs, Llama's gated MLP (``LlamaMLP``: ``gate_up_proj``, ``down_proj``, quantized and multiplied like
  any projection) with the config's ``hidden_activation`` (GELU-tanh);
- the mixture of experts beside the MLP (``enable_moe_block``: the 26B-A4B checkpoint). The router reads the
  layer's residual stream: ``softmax(proj(norm(h) * scale * hidden_size ** -0.5))`` in float32, the
  ``top_k_experts`` best renormalized to sum to 1, then each multiplied by its expert's
  ``per_expert_scale``; the experts read ``pre_feedforward_layernorm_2(h)``. Checkpoints keep a layer's
  experts stacked (``experts.gate_up_proj`` [experts, 2 x moe_intermediate_size, hidden], gate rows above
  up rows; ``experts.down_proj`` [experts, hidden, moe_intermediate_size]): read one expert at a time.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from .gemma3 import GemmaRMSNorm
from .llama import LlamaMLP
from .sparse_moe import mix_experts


class Gemma4RMSNorm(GemmaRMSNorm):
    """``norm(x) * weight`` in float32, rounded to x's dtype once (transformers' ``Gemma4RMSNorm``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x.float(), self.weight.float(), self.eps).to(x.dtype)


def unit_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight, in float32, rounded to x's dtype (``Gemma4RMSNorm(with_scale=False)``)."""
    return torch.rms_norm(x.float(), x.shape[-1:], None, eps).to(x.dtype)


def gemma4_mlp(config: Any, ops: Any, intermediate_size: int) -> LlamaMLP:
    """A gated MLP of ``intermediate_size`` with the config's ``hidden_activation``."""
    return LlamaMLP(SimpleNamespace(hidden_size=config.hidden_size, hidden_act=config.hidden_activation), ops,
                    intermediate_size)


class Gemma4Router(nn.Module):
    """Each token's experts and their weights, from the layer's residual stream (module docstring)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.proj = nn.Linear(config.hidden_size, config.num_experts, bias=False)  # stays float (not packed)
        self.scale = nn.Parameter(torch.ones(config.hidden_size), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.ones(config.num_experts), requires_grad=False)
        self.top_k, self.eps, self.root = config.top_k_experts, config.rms_norm_eps, config.hidden_size**-0.5

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 weights [T, top_k], the experts they weigh [T, top_k])."""
        scaled = unit_rms_norm(hidden, self.eps) * self.scale * self.root
        logits = nn.functional.linear(scaled, self.proj.weight)
        weights, chosen = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[chosen], chosen


class Gemma4Experts(nn.ModuleList):
    """``num_experts`` gated MLPs of ``moe_intermediate_size``, summed with the router's weights expert by
    expert in index order, as transformers sums them."""

    def __init__(self, config: Any, ops: Any) -> None:
        size = config.moe_intermediate_size
        super().__init__(gemma4_mlp(config, ops, size) for _ in range(config.num_experts))

    def forward(self, hidden: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        return mix_experts(self, hidden, weights, chosen)
