"""ERNIE 4.5 MoE (Baidu's ERNIE-4.5-21B-A3B, -300B-A47B): ERNIE 4.5's layers (models/ernie4_5.py: rotary on pairs
of adjacent values, ``use_bias`` on q/k/v/o and the dense MLPs) whose MLP is, in every ``moe_layer_interval``-th
layer from ``moe_layer_start_index`` to ``moe_layer_end_index``, a sparse mixture of ``moe_num_experts`` bias-free
experts of ``moe_intermediate_size`` (models/sparse_moe.py) plus ``moe_num_shared_experts`` shared ones, one
SwiGLU of that many times the size (biased by ``use_bias``) that every token runs through, ungated. The router
chooses a token's ``moe_k`` experts by their softmax probabilities plus a per-expert correction
(``moe_statics.e_score_correction_bias``, for the choice only) and weighs them by those probabilities divided by
their sum (at least ``moe_norm_min``). The LM head has a bias where ``use_bias`` is set (the dense 0.3B's has
none). Checkpoint names: ``mlp.gate``, ``mlp.experts.{e}.*``, ``mlp.shared_experts.*``,
``mlp.moe_statics.e_score_correction_bias`` [1, experts]; the multi-token-prediction layer (``model.mtp_*``) is
not served."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ..quant.attach import QuantizedShards
from .ernie4_5 import Ernie4_5ForCausalLM
from .llama import DecoderSpec, LlamaDecoderLayer, LlamaModel
from .names import parts_renamed
from .sparse_moe import SparseMoeBlock

RENAMED = ((".mlp.shared_experts.", ".mlp.shared_expert."),
           (".mlp.moe_statics.e_score_correction_bias", ".mlp.e_score_correction_bias"))


class Ernie4_5_MoeBlock(SparseMoeBlock):
    """The routed experts, the shared ones, and the router's correction bias [experts]."""

    def __init__(self, config: Any, ops: Any) -> None:
        shared = config.moe_intermediate_size * config.moe_num_shared_experts
        super().__init__(config, ops, config.moe_num_experts, config.moe_k, config.moe_intermediate_size,
                         normalize=True, shared_size=shared or None, shared_gate=False,
                         shared_bias=bool(config.use_bias))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.moe_num_experts), requires_grad=False)
        self.norm_min = config.moe_norm_min

    def routing(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The best ``top_k`` of the probabilities plus the correction, weighted by the probabilities alone."""
        logits = nn.functional.linear(hidden.float(), self.gate.weight.float())
        probs = torch.softmax(logits, dim=-1)
        _, chosen = torch.topk(probs + self.e_score_correction_bias.float(), self.top_k, dim=-1)
        weights = probs.gather(-1, chosen)
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=self.norm_min)
        return weights.to(hidden.dtype), chosen


def is_moe_layer(config: Any, index: int) -> bool:
    """Whether layer ``index`` has experts: every ``moe_layer_interval``-th from the start index to the end one."""
    end = config.moe_layer_end_index
    end = config.num_hidden_layers - 1 if end == -1 else end
    return (index + 1) % config.moe_layer_interval == 0 and config.moe_layer_start_index <= index <= end


class Ernie4_5_MoeDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int) -> nn.Module:
        if not is_moe_layer(config, layer_index):
            return super().make_mlp(config, ops, spec, layer_index)
        return Ernie4_5_MoeBlock(config, ops)


class Ernie4_5_MoeModel(LlamaModel):
    layer_class = Ernie4_5_MoeDecoderLayer


class Ernie4_5_MoeForCausalLM(Ernie4_5ForCausalLM):
    model_class = Ernie4_5_MoeModel
    #: experts are not split across ranks
    tensor_parallel_plan = None

    @property
    def lm_head_bias(self) -> bool:  # read by LlamaForCausalLM.__init__, after it sets self.config
        return bool(self.config.use_bias)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        return super().load_weights(_our_names(weights))


def _our_names(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors under ``Ernie4_5_MoeBlock``'s names, without the multi-token-prediction layer's."""
    for name, tensor in weights:
        if name.startswith("model.mtp_"):
            continue
        name = parts_renamed(name, RENAMED)
        if name.endswith(".e_score_correction_bias"):
            tensor = tensor.reshape(-1)  # [1, experts]: one group of experts
        yield name, tensor
