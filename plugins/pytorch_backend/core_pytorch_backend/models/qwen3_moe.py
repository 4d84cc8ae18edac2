"""Qwen3-MoE: Qwen3 whose MLP is, in every ``decoder_sparse_step``-th layer not in ``mlp_only_layers``, a
sparse mixture of ``num_experts`` experts of ``moe_intermediate_size`` (models/sparse_moe.py), each token
through its ``num_experts_per_tok`` best, renormalized when ``norm_topk_prob``. Checkpoint names
``mlp.gate`` (the router) and ``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``."""

from __future__ import annotations

from typing import Any

from torch import nn

from .llama import LlamaDecoderLayer, LlamaModel
from .qwen3 import Qwen3ForCausalLM
from .sparse_moe import SparseMoeBlock


def is_sparse_layer(config: Any, index: int) -> bool:
    return (index not in (getattr(config, "mlp_only_layers", None) or ()) and config.num_experts > 0
            and (index + 1) % config.decoder_sparse_step == 0)


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config: Any, ops: Any, layer_index: int) -> nn.Module:
        if not is_sparse_layer(config, layer_index):
            return super().make_mlp(config, ops, layer_index)
        return SparseMoeBlock(config, ops, config.num_experts, config.num_experts_per_tok,
                              config.moe_intermediate_size, bool(getattr(config, "norm_topk_prob", False)))


class Qwen3MoeModel(LlamaModel):
    layer_class = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    model_class = Qwen3MoeModel
    #: experts are not split across ranks
    tensor_parallel_plan = None
