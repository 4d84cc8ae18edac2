"""StarCoder 2 (``Starcoder2ForCausalLM``): Llama's pre-norm layers and attention with LayerNorm (weight and
bias, ``norm_epsilon``) in place of RMSNorm, biases on q/k/v/o and on the MLP (``use_bias``), an ungated MLP
(``c_proj(act(c_fc(x)))``, GELU-tanh) and ``sliding_window`` on every layer when set. Following
transformers' ``modeling_starcoder2``."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..layers import LayerNorm, RotaryEmbedding
from .llama import DecoderSpec, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from .ungated_mlp import UngatedMLP


class Starcoder2DecoderLayer(LlamaDecoderLayer):
    """Llama's layer (its forward) with StarCoder 2's norms and MLP."""

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding):
        nn.Module.__init__(self)  # not LlamaDecoderLayer's: its norms are RMSNorms, its MLP gated
        self.self_attn = LlamaAttention(config, ops, spec, layer_index, rotary)
        self.mlp = UngatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, ("c_fc", "c_proj"),
                              bias=bool(getattr(config, "use_bias", True)), ops=ops)
        self.input_layernorm = LayerNorm(config.hidden_size, config.norm_epsilon, ops=ops)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, config.norm_epsilon, ops=ops)


class Starcoder2Model(LlamaModel):
    layer_class = Starcoder2DecoderLayer

    def make_norm(self, config: Any, ops: Any) -> nn.Module:
        return LayerNorm(config.hidden_size, config.norm_epsilon)


class Starcoder2ForCausalLM(LlamaForCausalLM):
    model_class = Starcoder2Model
    tensor_parallel_plan = None  # its MLP is named c_fc / c_proj, which the Llama plan does not shard

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "use_bias", True))
        window = getattr(config, "sliding_window", None)
        return DecoderSpec(qkv_bias=bias, qk_norm=False, sliding_windows=(window,) * config.num_hidden_layers,
                           o_bias=bias)
