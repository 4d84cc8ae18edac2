"""Seed-OSS (ByteDance): Llama with q/k/v biases (``attention_bias``) apart from o_proj's
(``attention_out_bias``), and MLP biases when ``mlp_bias`` is set."""

from __future__ import annotations

from typing import Any

from .llama import DecoderSpec, LlamaForCausalLM


class SeedOssForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        return DecoderSpec(qkv_bias=bool(getattr(config, "attention_bias", False)), qk_norm=False,
                           sliding_windows=(None,) * config.num_hidden_layers,
                           o_bias=bool(getattr(config, "attention_out_bias", False)),
                           mlp_bias=bool(getattr(config, "mlp_bias", False)))
