"""GLM-4 (``GlmForCausalLM``: THUDM glm-4-9b): Llama whose rotary turns pairs of adjacent values
(``models.rotary_pairs``) on the first ``partial_rotary_factor`` of each head (half, the default), with q/k/v
biases where ``attention_bias`` (the default; never on o_proj), and gate and up stored fused
(``gate_up_proj``, as Phi-3's checkpoints store them and the model keeps them)."""

from __future__ import annotations

from typing import Any

from ..layers.rotary import rotary_dim_of
from .llama import DecoderSpec, LlamaForCausalLM, LlamaModel, head_dim_of
from .rotary_pairs import pairs_to_rotate_half


class GlmModel(LlamaModel):
    partial_rotary = True


class GlmForCausalLM(LlamaForCausalLM):
    model_class = GlmModel
    #: the fused gate_up_proj has no gate / up shards of its own to split across ranks
    tensor_parallel_plan = None

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        return DecoderSpec(qkv_bias=bool(getattr(config, "attention_bias", False)), qk_norm=False,
                           sliding_windows=(None,) * config.num_hidden_layers)

    def load_weights(self, weights):
        rotary_dim = rotary_dim_of(self.config, head_dim_of(self.config))
        return super().load_weights(pairs_to_rotate_half(weights, self.config, rotary_dim))
