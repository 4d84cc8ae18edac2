"""Qwen3-MoE: Qwen3 whose MLP is, in every ``decoder_sparse_step``-th layer not in ``mlp_only_layers``, a
sparse mixture of experts: a router (``mlp.gate``) scores the experts, each token runs through its
``num_experts_per_tok`` best (softmax probabilities, renormalized over those when ``norm_topk_prob``), and
their outputs are summed with those weights, expert by expert in index order, as transformers does. Each
expert is a SwiGLU MLP of ``moe_intermediate_size`` (checkpoint names ``mlp.experts.{e}.gate_proj`` ...),
so it is quantized and multiplied like any other; the router stays float."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..layers import RotaryEmbedding
from .llama import DecoderSpec, LlamaDecoderLayer, LlamaMLP, LlamaModel
from .qwen3 import Qwen3ForCausalLM


class SparseMoeBlock(nn.Module):
    def __init__(self, config: Any, ops: Any) -> None:
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(LlamaMLP(config, ops, config.moe_intermediate_size)
                                     for _ in range(config.num_experts))
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = bool(getattr(config, "norm_topk_prob", False))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(nn.functional.linear(hidden, self.gate.weight), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(hidden.dtype)
        out = torch.zeros_like(hidden)
        for expert in torch.unique(chosen).tolist():  # ascending, as transformers sums them
            tokens, slot = torch.where(chosen == expert)
            part = self.experts[expert](hidden[tokens]) * weights[tokens, slot, None]
            out.index_add_(0, tokens, part.to(out.dtype))
        return out


def is_sparse_layer(config: Any, index: int) -> bool:
    return (index not in (getattr(config, "mlp_only_layers", None) or ()) and config.num_experts > 0
            and (index + 1) % config.decoder_sparse_step == 0)


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding):
        super().__init__(config, ops, spec, layer_index, rotary)
        if is_sparse_layer(config, layer_index):
            self.mlp = SparseMoeBlock(config, ops)


class Qwen3MoeModel(LlamaModel):
    layer_class = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    model_class = Qwen3MoeModel
    #: experts are not split across ranks
    tensor_parallel_plan = None
