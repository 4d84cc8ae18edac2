"""Gemma 2: Gemma 3's text decoder (models/gemma3.py: sandwich norms, scaled embeddings, GELU-tanh MLP,
``query_pre_attn_scalar``, sliding layers by ``layer_types``, soft-capped logits) without the per-head q/k
norms, with one rotary table for every layer, and its attention scores soft-capped
(``attn_logit_softcapping``: 50 in the released checkpoints)."""

from __future__ import annotations

from typing import Any

from ..layers.rotary import rope_parameters
from .gemma3 import LAYER_TYPES, Gemma3ForCausalLM, Gemma3Model
from .llama import DecoderSpec, layer_types_windows


class Gemma2Model(Gemma3Model):
    @staticmethod
    def rope_parameters_by_layer_type(config: Any) -> dict[str, dict[str, Any]]:
        return dict.fromkeys(LAYER_TYPES, rope_parameters(config))


class Gemma2ForCausalLM(Gemma3ForCausalLM):
    model_class = Gemma2Model

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderSpec(qkv_bias=bias, qk_norm=False, sliding_windows=layer_types_windows(config), o_bias=bias,
                           attn_softcap=getattr(config, "attn_logit_softcapping", None))
