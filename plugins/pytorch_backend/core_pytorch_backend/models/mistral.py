"""Mistral: Llama with an optional sliding attention window on every layer."""

from __future__ import annotations

from typing import Any

from .llama import DecoderSpec, LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        window = getattr(config, "sliding_window", None)
        # no biases whatever the config says: transformers' Mistral has none
        return DecoderSpec(qkv_bias=False, qk_norm=False, sliding_windows=(window,) * config.num_hidden_layers)
