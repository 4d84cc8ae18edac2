"""ERNIE 4.5 (Baidu; the dense 0.3B): Llama whose rotary turns pairs of adjacent values (``models.rotary_pairs``),
and whose one ``use_bias`` puts biases on q, k, v, o and the MLP's projections."""

from __future__ import annotations

from typing import Any

from .llama import DecoderSpec, LlamaForCausalLM
from .rotary_pairs import pairs_to_rotate_half


class Ernie4_5ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "use_bias", False))
        return DecoderSpec(qkv_bias=bias, qk_norm=False, sliding_windows=(None,) * config.num_hidden_layers,
                           o_bias=bias, mlp_bias=bias)

    def load_weights(self, weights):
        return super().load_weights(pairs_to_rotate_half(weights, self.config))
