"""Jais 2 (Inception / MBZUAI): Llama's pre-norm layers and attention (q/k/v/o biases by ``attention_bias``) with
LayerNorms (weight and bias, ``layer_norm_eps``) in place of RMSNorms and Nemotron's ungated MLP,
``down(relu(up(x)) ** 2)`` with biases by ``mlp_bias``."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..layers import LayerNorm, RotaryEmbedding
from .llama import DecoderSpec, LayerNormModel, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from .ungated_mlp import UngatedMLP


class Jais2DecoderLayer(LlamaDecoderLayer):
    """Llama's layer (its forward) with Jais 2's norms and MLP."""

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding):
        nn.Module.__init__(self)  # not LlamaDecoderLayer's: its norms are RMSNorms, its MLP gated
        self.self_attn = LlamaAttention(config, ops, spec, layer_index, rotary)
        self.mlp = UngatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                              ("up_proj", "down_proj"), bias=spec.mlp_bias, ops=ops)
        # the op set's LayerNorm and relu^2: the native decode stack calls their kernels
        self.input_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps, ops=ops)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps, ops=ops)


class Jais2Model(LayerNormModel):
    layer_class = Jais2DecoderLayer


class Jais2ForCausalLM(LlamaForCausalLM):
    model_class = Jais2Model
