"""Gemma (the first generation, ``GemmaForCausalLM``): Llama's two norms a layer, with Gemma's parts
(models/gemma3.py): RMSNorm scaled by ``1 + weight`` in float32, embeddings times ``sqrt(hidden_size)``,
and a gated MLP of ``config.hidden_act`` (GELU-tanh in the released checkpoints); attention scaled by
``head_dim ** -0.5``, one rotary table, no windows, no soft caps. Following transformers' ``modeling_gemma``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import RotaryEmbedding, VocabEmbedding
from ..layers.rotary import context_positions, rope_parameters
from .gemma3 import Gemma3Attention, Gemma3ForCausalLM, Gemma3MLP, Gemma3Model, GemmaRMSNorm
from .llama import DecoderSpec, head_dim_of, input_norm


class GemmaDecoderLayer(nn.Module):
    """``h += attn(input_norm(h))``, then ``h += mlp(post_attention_norm(h))``, in the Llama layers'
    ``(hidden, residual)`` protocol (each norm adds the residual in first)."""

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary_emb: RotaryEmbedding):
        super().__init__()
        self.self_attn = Gemma3Attention(config, ops, spec, layer_index, rotary_emb)
        # Gemma's hidden_act; VaultGemma's config names only Gemma 2's hidden_activation, which Gemma3MLP reads
        self.mlp = Gemma3MLP(config, ops, activation=getattr(config, "hidden_act", None))
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        normed, residual = input_norm(self.input_layernorm, hidden, residual)
        attn = self.self_attn(normed, positions, meta)
        normed, residual = self.post_attention_layernorm(attn, residual)
        return self.mlp(normed), residual


class GemmaModel(Gemma3Model):
    """Gemma 3's scaled embedding and final norm around Gemma's layers, all sharing one rotary table."""

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec):
        nn.Module.__init__(self)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.register_buffer("embed_scale", torch.tensor(float(config.hidden_size) ** 0.5), persistent=False)
        rotary = RotaryEmbedding(head_dim_of(config), context_positions(config), rope_parameters(config), ops)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, ops, spec, i, rotary)
                                    for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, ops)


class GemmaForCausalLM(Gemma3ForCausalLM):
    model_class = GemmaModel

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderSpec(qkv_bias=bias, qk_norm=False, sliding_windows=(None,) * config.num_hidden_layers,
                           o_bias=bias)
