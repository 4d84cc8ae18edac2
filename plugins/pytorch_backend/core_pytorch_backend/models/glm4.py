"""GLM-4-0414 (``Glm4ForCausalLM``): GLM (``models.glm``) whose layers also normalize what the attention and
the MLP return before adding it to the residual (``post_self_attn_layernorm``, ``post_mlp_layernorm``),
beside Llama's input and post-attention norms."""

from __future__ import annotations

from typing import Any

from ..layers import RMSNorm
from .glm import GlmForCausalLM
from .llama import LlamaDecoderLayer, LlamaModel


class Glm4DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: Any, ops: Any, *args: Any) -> None:
        super().__init__(config, ops, *args)
        self.post_self_attn_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_mlp_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, positions, hidden, residual, meta):
        hidden, residual = self.normed_input(hidden, residual)
        hidden = self.post_self_attn_layernorm(self.self_attn(hidden, positions, meta))
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.post_mlp_layernorm(self.mlp(hidden)), residual  # the next norm adds it to the residual


class Glm4Model(LlamaModel):
    layer_class = Glm4DecoderLayer
    partial_rotary = True


class Glm4ForCausalLM(GlmForCausalLM):
    model_class = Glm4Model
