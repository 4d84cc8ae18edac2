"""Helium (Kyutai): Llama whose rotary turns pairs of adjacent values (``models.rotary_pairs``), with q/k/v biases
when ``attention_bias`` is set (never on o_proj) and MLP biases when ``mlp_bias`` is."""

from __future__ import annotations

from typing import Any

from .llama import DecoderSpec, LlamaForCausalLM
from .rotary_pairs import pairs_to_rotate_half


class HeliumForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        return DecoderSpec(qkv_bias=bool(getattr(config, "attention_bias", False)), qk_norm=False,
                           sliding_windows=(None,) * config.num_hidden_layers,
                           mlp_bias=bool(getattr(config, "mlp_bias", False)))

    def load_weights(self, weights):
        return super().load_weights(pairs_to_rotate_half(weights, self.config))
