"""Granite (IBM Granite 3.x): Llama with four multipliers: the embeddings times ``embedding_multiplier``,
what each attention and MLP adds to the residual times ``residual_multiplier``, ``attention_multiplier`` as
the softmax scale, and the logits divided by ``logits_scaling``."""

from __future__ import annotations

from typing import Any

import torch

from .llama import DecoderSpec, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class GraniteDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: Any, *args: Any) -> None:
        super().__init__(config, *args)
        self.residual_multiplier = self.residual_multiplier_of(config)

    @classmethod
    def residual_multiplier_of(cls, config: Any) -> float:
        """What the attention's and the MLP's outputs are multiplied by (MiniCPM3 derives it from its depth)."""
        return float(config.residual_multiplier)

    def forward(self, positions, hidden, residual, meta):
        hidden, residual = self.normed_input(hidden, residual)
        hidden = self.self_attn(hidden, positions, meta) * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden) * self.residual_multiplier, residual  # the next norm adds it to the residual


class GraniteModel(LlamaModel):
    layer_class = GraniteDecoderLayer

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec) -> None:
        super().__init__(config, ops, spec)
        self.embedding_multiplier = float(config.embedding_multiplier)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    model_class = GraniteModel

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderSpec(qkv_bias=bias, qk_norm=False, sliding_windows=(None,) * config.num_hidden_layers,
                           o_bias=bias, attention_scale=float(config.attention_multiplier),
                           mlp_bias=bool(getattr(config, "mlp_bias", False)))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) / self.config.logits_scaling
