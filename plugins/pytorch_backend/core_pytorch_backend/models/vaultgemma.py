"""VaultGemma (Google's differentially private Gemma): Gemma 2 (models/gemma2.py: scaled embeddings, GELU-tanh MLP
of ``hidden_activation``, ``query_pre_attn_scalar``, windowed layers by ``layer_types``, soft-capped attention
scores and logits) with two norms a layer, pre-norm only, as the first Gemma's (models/gemma.py's layer): its
``pre_feedforward_layernorm``, before the MLP, is read as that layer's ``post_attention_layernorm``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..quant.attach import QuantizedShards
from .gemma import GemmaDecoderLayer
from .gemma2 import Gemma2ForCausalLM, Gemma2Model
from .names import parts_renamed

RENAMED = ((".pre_feedforward_layernorm.", ".post_attention_layernorm."),)


class VaultGemmaModel(Gemma2Model):
    layer_class = GemmaDecoderLayer


class VaultGemmaForCausalLM(Gemma2ForCausalLM):
    model_class = VaultGemmaModel

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        return super().load_weights((parts_renamed(name, RENAMED), tensor) for name, tensor in weights)
