"""Command A's mixture of experts (``Cohere2MoeForCausalLM``): Cohere 2 (models/cohere2.py: attention and MLP side by
side on one input norm, pair rotary on the windowed layers alone, the logits times ``logit_scale``) whose MLPs are,
where ``mlp_layer_types`` says "sparse", ``num_experts`` SwiGLU experts of ``intermediate_size`` (models/sparse_moe.py)
and elsewhere dense MLPs of ``prefix_dense_intermediate_size``, which take rotary too when
``prefix_dense_sliding_window_pattern`` is 1. A token runs through its best ``num_experts_per_tok`` router logits'
experts, weighted by those logits' softmax (``expert_selection_fn`` "softmax") or by their sigmoids, renormalized
where ``norm_topk_prob`` ("sigmoid"); a shared MLP ``num_shared_experts`` experts wide is added to the routed
experts' sum ("sum") or averaged with it ("average": ``shared_expert_combination_strategy``). The norms are
RMSNorms where ``rms_norm_eps`` is set, Cohere's LayerNorm otherwise. Following transformers'
``modeling_cohere2_moe``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..layers import RMSNorm
from ..quant.attach import QuantizedShards
from .cohere import CohereDecoderLayer, CohereLayerNorm, CohereModel
from .cohere2 import Cohere2ForCausalLM
from .llama import DecoderSpec, LlamaMLP, layer_types_windows
from .sparse_moe import SparseMoeBlock

SELECTIONS = ("softmax", "sigmoid")
COMBINATIONS = ("sum", "average")


class Cohere2MoeBlock(SparseMoeBlock):
    """The softmax of the best ``top_k`` logits (``SparseMoeBlock``'s ``softmax_of_top_k``) and an ungated shared
    MLP, whose output is averaged with the routed experts' where ``average``."""

    def __init__(self, config: Any, ops: Any) -> None:
        shared = config.num_shared_experts * config.intermediate_size
        super().__init__(config, ops, config.num_experts, config.num_experts_per_tok, config.intermediate_size,
                         normalize=config.expert_selection_fn == "sigmoid" and bool(config.norm_topk_prob),
                         shared_size=shared or None, shared_gate=False,
                         softmax_of_top_k=True)
        self.average = bool(shared) and config.shared_expert_combination_strategy == "average"

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = super().forward(hidden)  # the routed experts' sum plus the shared MLP's output
        return out / 2 if self.average else out


class Cohere2MoeSigmoidBlock(Cohere2MoeBlock):
    """``expert_selection_fn`` "sigmoid": the best ``top_k`` logits' sigmoids, divided by their sum where
    ``normalize``."""

    def routing(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = nn.functional.linear(hidden, self.gate.weight)
        best, chosen = torch.topk(logits, self.top_k, dim=-1)
        weights = torch.sigmoid(best)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, chosen


def moe_block(config: Any, ops: Any) -> Cohere2MoeBlock:
    """A sparse layer's block, by ``expert_selection_fn``."""
    return (Cohere2MoeSigmoidBlock if config.expert_selection_fn == "sigmoid" else Cohere2MoeBlock)(config, ops)


class Cohere2MoeDecoderLayer(CohereDecoderLayer):
    def make_mlp(self, config: Any, ops: Any, layer_index: int) -> nn.Module:
        if config.mlp_layer_types[layer_index] == "dense":
            return LlamaMLP(config, ops, config.prefix_dense_intermediate_size)
        return moe_block(config, ops)

    def make_norm(self, config: Any, ops: Any) -> nn.Module:
        return norm_of(config, ops)


class Cohere2MoeModel(CohereModel):
    layer_class = Cohere2MoeDecoderLayer

    def make_norm(self, config: Any, ops: Any) -> nn.Module:
        return norm_of(config, ops)


def norm_of(config: Any, ops: Any) -> nn.Module:
    if config.rms_norm_eps is not None:
        return RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
    return CohereLayerNorm(config.hidden_size, config.layer_norm_eps)


class Cohere2MoeForCausalLM(Cohere2ForCausalLM):
    model_class = Cohere2MoeModel

    def __init__(self, config: Any, ops: Any):
        if config.expert_selection_fn not in SELECTIONS:
            raise NotImplementedError(f"Cohere2Moe: expert_selection_fn {config.expert_selection_fn!r} is not "
                                      f"supported (supported: {', '.join(SELECTIONS)})")
        if config.shared_expert_combination_strategy not in COMBINATIONS:
            raise NotImplementedError("Cohere2Moe: shared_expert_combination_strategy "
                                      f"{config.shared_expert_combination_strategy!r} is not supported "
                                      f"(supported: {', '.join(COMBINATIONS)})")
        super().__init__(config, ops)

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))
        windows = layer_types_windows(config)
        dense_rope = config.prefix_dense_sliding_window_pattern == 1
        rope = tuple(window is not None or (dense_rope and kind == "dense")
                     for window, kind in zip(windows, config.mlp_layer_types, strict=True))
        return DecoderSpec(qkv_bias=bias, qk_norm=False, sliding_windows=windows, o_bias=bias, rope_layers=rope)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        return super().load_weights((name.replace(".mlp.shared_experts.", ".mlp.shared_expert."), tensor)
                                    for name, tensor in weights)
