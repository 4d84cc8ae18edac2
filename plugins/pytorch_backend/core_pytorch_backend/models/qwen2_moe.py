"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 whose MLP is, in every ``decoder_sparse_step``-th layer
not in ``mlp_only_layers``, a sparse mixture of ``num_experts`` experts of ``moe_intermediate_size`` plus a
shared expert of ``shared_expert_intermediate_size`` behind a sigmoid gate (models/sparse_moe.py)."""

from __future__ import annotations

from typing import Any

from .llama import DecoderSpec, layer_types_windows
from .qwen2 import Qwen2ForCausalLM
from .sparse_moe import QwenMoeModel, without_empty_shared_expert


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    model_class = QwenMoeModel
    #: experts are not split across ranks
    tensor_parallel_plan = None

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        """Qwen2's, with q/k/v biases as the config's ``qkv_bias`` says (a field Qwen2-MoE has, Qwen2 not)."""
        return DecoderSpec(qkv_bias=bool(getattr(config, "qkv_bias", True)), qk_norm=False,
                           sliding_windows=layer_types_windows(config))

    def load_weights(self, weights):
        return super().load_weights(without_empty_shared_expert(weights, self.config))
