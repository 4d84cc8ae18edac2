"""Arcee (AFM-4.5B): Llama with an ungated MLP, ``down(relu(up(x)) ** 2)`` (Nemotron's), biases where
``mlp_bias`` says; relu^2 is the op set's (the native decode stack's kernel)."""

from __future__ import annotations

from typing import Any

from torch import nn

from .llama import DecoderSpec, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from .ungated_mlp import UngatedMLP


class ArceeDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int) -> nn.Module:
        return UngatedMLP(config.hidden_size, config.intermediate_size, getattr(config, "hidden_act", "relu2"),
                          ("up_proj", "down_proj"), bias=bool(getattr(config, "mlp_bias", False)), ops=ops)


class ArceeModel(LlamaModel):
    layer_class = ArceeDecoderLayer


class ArceeForCausalLM(LlamaForCausalLM):
    model_class = ArceeModel
