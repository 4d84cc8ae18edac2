"""OLMo (``OlmoForCausalLM``, AI2's first OLMo): Llama with LayerNorms that have no weight or bias
(``layers.ParameterFreeLayerNorm``) and, where ``clip_qkv`` is set, q, k and v clamped to ±clip_qkv before
rotary. Following transformers' ``modeling_olmo``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import ParameterFreeLayerNorm, RotaryEmbedding
from .llama import DecoderSpec, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class OlmoAttention(LlamaAttention):
    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding):
        super().__init__(config, ops, spec, layer_index, rotary)
        self.clip = getattr(config, "clip_qkv", None)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.clip is None:
            return super().forward(hidden, positions, meta)
        q, k, v = (t.clamp(-self.clip, self.clip) for t in self.qkv_proj.split(self.qkv_proj(hidden)))
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta))


class OlmoDecoderLayer(LlamaDecoderLayer):
    """Llama's layer (its forward) with OLMo's attention and norms."""

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding):
        nn.Module.__init__(self)  # not LlamaDecoderLayer's: its norms have weights
        self.self_attn = OlmoAttention(config, ops, spec, layer_index, rotary)
        self.mlp = self.make_mlp(config, ops, spec, layer_index)
        self.input_layernorm = ParameterFreeLayerNorm()
        self.post_attention_layernorm = ParameterFreeLayerNorm()


class OlmoModel(LlamaModel):
    layer_class = OlmoDecoderLayer

    def make_norm(self, config: Any, ops: Any) -> nn.Module:
        return ParameterFreeLayerNorm()


class OlmoForCausalLM(LlamaForCausalLM):
    model_class = OlmoModel

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderSpec(qkv_bias=bias, qk_norm=False, sliding_windows=(None,) * config.num_hidden_layers,
                           o_bias=bias)
