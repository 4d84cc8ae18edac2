"""Qwen3-MoE: Qwen3 whose MLP is, in every ``decoder_sparse_step``-th layer not in ``mlp_only_layers``, a
sparse mixture of ``num_experts`` experts of ``moe_intermediate_size`` (models/sparse_moe.py), each token
through its ``num_experts_per_tok`` best, renormalized when ``norm_topk_prob``. Checkpoint names
``mlp.gate`` (the router) and ``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``."""

from __future__ import annotations

from typing import Any

from .llama import DecoderSpec
from .qwen3 import Qwen3ForCausalLM
from .sparse_moe import QwenMoeModel


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    model_class = QwenMoeModel
    #: experts are not split across ranks
    tensor_parallel_plan = None

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        """Qwen3's, with ``sliding_window`` on every layer where set (its config clears it unless
        ``use_sliding_window``), as transformers' Qwen3-MoE applies it: it has no ``layer_types``."""
        bias = bool(getattr(config, "attention_bias", False))
        window = getattr(config, "sliding_window", None)
        return DecoderSpec(qkv_bias=bias, qk_norm=True, sliding_windows=(window,) * config.num_hidden_layers,
                           o_bias=bias)
