"""Qwen2: Llama with q/k/v biases (and per-layer sliding windows from ``layer_types``)."""

from __future__ import annotations

from typing import Any

from .llama import DecoderSpec, LlamaForCausalLM, layer_types_windows


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        return DecoderSpec(qkv_bias=True, qk_norm=False, sliding_windows=layer_types_windows(config))
