"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2 whose MLP is, in every ``decoder_sparse_step``-th layer
not in ``mlp_only_layers``, a sparse mixture of ``num_experts`` experts of ``moe_intermediate_size`` plus a
shared expert of ``shared_expert_intermediate_size`` behind a sigmoid gate (models/sparse_moe.py)."""

from __future__ import annotations

from .qwen2 import Qwen2ForCausalLM
from .sparse_moe import QwenMoeModel


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    model_class = QwenMoeModel
    #: experts are not split across ranks
    tensor_parallel_plan = None
