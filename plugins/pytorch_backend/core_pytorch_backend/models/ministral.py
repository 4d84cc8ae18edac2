"""Ministral (Mistral AI's 8B of 2024): Mistral with a sliding window per layer as ``layer_types`` says, and no
biases."""

from __future__ import annotations

from typing import Any

from .llama import DecoderSpec, LlamaForCausalLM, layer_types_windows


class MinistralForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        return DecoderSpec(qkv_bias=False, qk_norm=False, sliding_windows=layer_types_windows(config))
