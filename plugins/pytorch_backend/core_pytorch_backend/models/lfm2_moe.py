"""LFM2-MoE (Liquid AI's LFM2-8B-A1B): LFM2's short-convolution and attention layers (models/lfm2.py) whose MLP
is, past the first ``num_dense_layers`` (dense SwiGLUs of ``intermediate_size``, not reshaped as LFM2's), a
sparse mixture of ``num_experts`` SwiGLU experts of ``moe_intermediate_size`` (models/sparse_moe.py), each token
through its ``num_experts_per_tok`` best, following transformers' ``modeling_lfm2_moe``.

The router scores each expert by the sigmoid of its logit; the choice ranks those scores plus a per-expert
bias (``feed_forward.expert_bias``, float32, with ``use_expert_bias``; the weights take the scores alone); the
chosen scores are divided by their sum plus 1e-6 where ``norm_topk_prob``, then multiplied by
``routed_scaling_factor``. Checkpoint names: ``feed_forward.gate`` (the router),
``feed_forward.experts.{e}.w1`` / ``w3`` / ``w2`` (one tensor per expert, as the published checkpoints and
transformers' save store them)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .lfm2 import Lfm2DecoderLayer, Lfm2ForCausalLM, Lfm2Model
from .sparse_moe import SparseMoeBlock

SUM_EPS = 1e-6  # added to the chosen scores' sum, as transformers does


class Lfm2MoeBlock(SparseMoeBlock):
    """The experts and their sigmoid router, with the choice's ``expert_bias`` [experts] where the config
    uses one."""

    def __init__(self, config: Any, ops: Any) -> None:
        super().__init__(config, ops, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                         normalize=bool(config.norm_topk_prob))
        bias = nn.Parameter(torch.zeros(config.num_experts), requires_grad=False)
        self.expert_bias = bias if config.use_expert_bias else None
        self.scale = float(config.routed_scaling_factor)

    def routing(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The best ``top_k`` of the scores (plus the bias), weighted by their scores, normalized and scaled."""
        scores = torch.sigmoid(nn.functional.linear(hidden, self.gate.weight).float())
        ranked = scores if self.expert_bias is None else scores + self.expert_bias.float()
        chosen = torch.topk(ranked, self.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + SUM_EPS)
        return (weights * self.scale).to(hidden.dtype), chosen


class Lfm2MoeDecoderLayer(Lfm2DecoderLayer):
    def make_mlp(self, config: Any, ops: Any, layer_index: int) -> nn.Module:
        if layer_index < config.num_dense_layers:
            return super().make_mlp(config, ops, layer_index)
        return Lfm2MoeBlock(config, ops)


class Lfm2MoeModel(Lfm2Model):
    layer_class = Lfm2MoeDecoderLayer


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    model_class = Lfm2MoeModel
    family = "LFM2-MoE"
