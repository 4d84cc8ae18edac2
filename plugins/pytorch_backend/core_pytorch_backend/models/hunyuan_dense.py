"""Hunyuan dense (Tencent's HunYuanDenseV1: the 0.5B-7B models): Llama whose q and k are RMS-normalized head by
head after rotary (``query_layernorm`` / ``key_layernorm``), with the fixed NTK ``alpha`` its checkpoints label
``dynamic``: the rotary base stretched once to ``rope_theta * alpha ** (d / (d - 2))``, as transformers'
Hunyuan computes it."""

from __future__ import annotations

from typing import Any

import torch

from ..attention_metadata import AttentionMetadata
from ..layers import RMSNorm
from ..layers.rotary import rope_parameters
from .llama import DecoderSpec, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, head_dim_of


class HunYuanDenseV1Attention(LlamaAttention):
    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: Any):
        super().__init__(config, ops, spec, layer_index, rotary)
        self.query_layernorm = RMSNorm(self.head_dim, config.rms_norm_eps, ops)
        self.key_layernorm = RMSNorm(self.head_dim, config.rms_norm_eps, ops)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q, k = self.rotary_emb(positions, q, k)
        t = q.shape[0]
        q = self.query_layernorm(q.reshape(t, -1, self.head_dim)).reshape(t, -1)
        k = self.key_layernorm(k.reshape(t, -1, self.head_dim)).reshape(t, -1)
        return self.o_proj(self.attn(q, k, v, meta))


class HunYuanDenseV1DecoderLayer(LlamaDecoderLayer):
    attention_class = HunYuanDenseV1Attention


class HunYuanDenseV1Model(LlamaModel):
    layer_class = HunYuanDenseV1DecoderLayer


class HunYuanDenseV1ForCausalLM(LlamaForCausalLM):
    model_class = HunYuanDenseV1Model

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))  # q, k, v and o; never the MLP
        return DecoderSpec(qkv_bias=bias, qk_norm=False, sliding_windows=(None,) * config.num_hidden_layers,
                           o_bias=bias)

    def __init__(self, config: Any, ops: Any):
        params = rope_parameters(config)
        if params["rope_type"] == "dynamic" and params.get("alpha"):  # transformers' "ntk_alpha"
            dim = head_dim_of(config)
            theta = float(params["rope_theta"]) * float(params["alpha"]) ** (dim / (dim - 2))
            config.rope_parameters = {"rope_type": "default", "rope_theta": theta}
        super().__init__(config, ops)
