"""OLMoE (AI2's 1B-7B): Llama's pre-norm layers with OLMo 2's q and k RMS-normalized over their whole projection
before rotary, q/k/v clamped by ``clip_qkv`` where set, and every MLP a sparse mixture of ``num_experts``
experts of ``intermediate_size`` (models/sparse_moe.py), each token through its ``num_experts_per_tok`` best,
renormalized when ``norm_topk_prob``. Checkpoint names as Qwen-MoE's (``mlp.gate``, ``mlp.experts.{e}.*``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from .llama import DecoderSpec, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from .olmo2 import Olmo2Attention
from .sparse_moe import SparseMoeBlock


class OlmoeAttention(Olmo2Attention):
    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: Any):
        super().__init__(config, ops, spec, layer_index, rotary)
        self.clip_qkv = getattr(config, "clip_qkv", None)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        if self.clip_qkv is not None:  # after the norms, as transformers clamps them
            q, k, v = (x.clamp(-self.clip_qkv, self.clip_qkv) for x in (q, k, v))
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta))


class OlmoeDecoderLayer(LlamaDecoderLayer):
    attention_class = OlmoeAttention

    def make_mlp(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int) -> nn.Module:
        return SparseMoeBlock(config, ops, config.num_experts, config.num_experts_per_tok, config.intermediate_size,
                              normalize=bool(getattr(config, "norm_topk_prob", False)))


class OlmoeModel(LlamaModel):
    layer_class = OlmoeDecoderLayer


class OlmoeForCausalLM(LlamaForCausalLM):
    model_class = OlmoeModel
    #: q and k are normalized over all heads at once, and experts are not split across ranks
    tensor_parallel_plan = None

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))
        window = getattr(config, "sliding_window", None)  # every layer's, as transformers passes it
        return DecoderSpec(qkv_bias=bias, qk_norm=False, sliding_windows=(window,) * config.num_hidden_layers,
                           o_bias=bias)
