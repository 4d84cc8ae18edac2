"""SmolLM3: Llama whose layers listed off in ``no_rope_layers`` (every fourth in SmolLM3-3B) apply no rotary
embedding, with sliding windows where ``layer_types`` says so."""

from __future__ import annotations

from typing import Any

from .llama import DecoderSpec, LlamaForCausalLM, layer_types_windows


class SmolLM3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))  # q, k, v and o alike, as transformers
        rope = getattr(config, "no_rope_layers", None)  # 1: the layer uses rotary (transformers' naming)
        return DecoderSpec(qkv_bias=bias, qk_norm=False, sliding_windows=layer_types_windows(config), o_bias=bias,
                           rope_layers=None if rope is None else tuple(bool(r) for r in rope),
                           mlp_bias=bool(getattr(config, "mlp_bias", False)))
