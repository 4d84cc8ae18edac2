"""VaultGemma (Google's differentially private Gemma): Gemma 2 (models/gemma2.py: scaled embeddings, GELU-tanh MLP
of ``hidden_activation``, ``query_pre_attn_scalar``, windowed layers by ``layer_types``, soft-capped attention
scores and logits) with two norms a layer, pre-norm only: ``input_layernorm`` before attention and
``pre_feedforward_layernorm`` before the MLP (no norms of their outputs)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import RotaryEmbedding
from .gemma2 import Gemma2ForCausalLM, Gemma2Model
from .gemma3 import Gemma3Attention, Gemma3MLP, GemmaRMSNorm
from .llama import DecoderSpec, input_norm


class VaultGemmaDecoderLayer(nn.Module):
    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary_emb: RotaryEmbedding):
        super().__init__()
        self.self_attn = Gemma3Attention(config, ops, spec, layer_index, rotary_emb)
        self.mlp = Gemma3MLP(config, ops)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        normed, residual = input_norm(self.input_layernorm, hidden, residual)
        attn = self.self_attn(normed, positions, meta)
        normed, residual = self.pre_feedforward_layernorm(attn, residual)
        return self.mlp(normed), residual


class VaultGemmaModel(Gemma2Model):
    layer_class = VaultGemmaDecoderLayer


class VaultGemmaForCausalLM(Gemma2ForCausalLM):
    model_class = VaultGemmaModel
