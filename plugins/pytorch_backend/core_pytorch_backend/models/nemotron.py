"""Nemotron (``NemotronForCausalLM``: Nemotron-4, Minitron): Llama's layout with LayerNorms whose weight is
stored less one (``LayerNorm1P``: weight + 1, and a bias), an ungated MLP ``down(relu(up(x)) ** 2)``
(``hidden_act`` relu2), rotary on the first ``partial_rotary_factor`` of each head (half, the default), and
biases where ``attention_bias`` (q/k/v/o) and ``mlp_bias`` say. Following transformers'
``modeling_nemotron``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..layers import LayerNorm, RotaryEmbedding
from .llama import DecoderSpec, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from .ungated_mlp import UngatedMLP


class LayerNorm1P(LayerNorm):
    """transformers' ``NemotronLayerNorm1P``: a LayerNorm scaled by its weight plus one."""

    def scale(self) -> torch.Tensor:
        return self.weight + 1.0


class NemotronDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding):
        nn.Module.__init__(self)  # LlamaDecoderLayer's norms are RMSNorms
        self.self_attn = LlamaAttention(config, ops, spec, layer_index, rotary)
        self.mlp = UngatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                              ("up_proj", "down_proj"), bias=bool(getattr(config, "mlp_bias", False)), ops=ops)
        # the op set's LayerNorm and relu^2: the native decode stack calls their kernels
        self.input_layernorm = LayerNorm1P(config.hidden_size, config.norm_eps, ops=ops)
        self.post_attention_layernorm = LayerNorm1P(config.hidden_size, config.norm_eps, ops=ops)


class NemotronModel(LlamaModel):
    layer_class = NemotronDecoderLayer
    partial_rotary = True

    def make_norm(self, config: Any, ops: Any) -> nn.Module:
        return LayerNorm1P(config.hidden_size, config.norm_eps)


class NemotronForCausalLM(LlamaForCausalLM):
    model_class = NemotronModel
