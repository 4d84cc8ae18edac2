"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 whose MLP is, in every ``decoder_sparse_step``-th layer
not in ``mlp_only_layers``, a sparse mixture of ``num_experts`` experts of ``moe_intermediate_size`` plus a
shared expert of ``shared_expert_intermediate_size`` behind a sigmoid gate (models/sparse_moe.py)."""

from __future__ import annotations

from typing import Any

from torch import nn

from .llama import LlamaDecoderLayer, LlamaModel
from .qwen2 import Qwen2ForCausalLM
from .qwen3_moe import is_sparse_layer
from .sparse_moe import SparseMoeBlock


class Qwen2MoeDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config: Any, ops: Any, layer_index: int) -> nn.Module:
        if not is_sparse_layer(config, layer_index):
            return super().make_mlp(config, ops, layer_index)
        return SparseMoeBlock(config, ops, config.num_experts, config.num_experts_per_tok,
                              config.moe_intermediate_size, bool(getattr(config, "norm_topk_prob", False)),
                              shared_size=config.shared_expert_intermediate_size)


class Qwen2MoeModel(LlamaModel):
    layer_class = Qwen2MoeDecoderLayer


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    model_class = Qwen2MoeModel
    #: experts are not split across ranks
    tensor_parallel_plan = None
