"""Qwen3: Llama with per-head RMSNorm on q and k before rotary, no q/k/v bias by default."""

from __future__ import annotations

from typing import Any

from .llama import DecoderSpec, LlamaForCausalLM, layer_types_windows


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))  # q, k, v and o alike, as transformers
        return DecoderSpec(qkv_bias=bias, qk_norm=True, sliding_windows=layer_types_windows(config), o_bias=bias)
