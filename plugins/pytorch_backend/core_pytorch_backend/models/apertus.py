"""Apertus (Swiss AI): Llama's layers (q/k/v/o biases when ``attention_bias`` is set) with q and k RMS-normalized
head by head before rotary, and an ungated MLP without biases, ``down(xielu(up(x)))``: xIELU
(``layers.activation.XIELU``) has learned parameters per layer, ``mlp.act_fn.alpha_p`` / ``alpha_n`` (and its
``beta`` / ``eps``, kept as buffers). The layers' norms are named ``attention_layernorm`` and
``feedforward_layernorm`` in its checkpoints, Llama's ``input_layernorm`` / ``post_attention_layernorm`` here."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..layers import Activation, Linear
from ..layers.activation import XIELU
from ..quant.attach import QuantizedShards
from .llama import DecoderSpec, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from .names import parts_renamed

RENAMED = ((".attention_layernorm.", ".input_layernorm."),
           (".feedforward_layernorm.", ".post_attention_layernorm."))
XIELU_BUFFERS = (".act_fn.beta", ".act_fn.eps")


class ApertusMLP(nn.Module):
    def __init__(self, config: Any, ops: Any = None):
        super().__init__()
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        act = getattr(config, "hidden_act", "xielu")
        self.act_fn = XIELU(ops=ops) if act == "xielu" else Activation(act)  # the op set's xIELU: the native stack's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))


class ApertusDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int) -> nn.Module:
        return ApertusMLP(config, ops)


class ApertusModel(LlamaModel):
    layer_class = ApertusDecoderLayer


class ApertusForCausalLM(LlamaForCausalLM):
    model_class = ApertusModel

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderSpec(qkv_bias=bias, qk_norm=True, sliding_windows=(None,) * config.num_hidden_layers,
                           o_bias=bias)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        return super().load_weights(self._xielu_buffers_copied((parts_renamed(name, RENAMED), tensor)
                                                               for name, tensor in weights))

    def _xielu_buffers_copied(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        """The tensors, less xIELU's ``beta`` and ``eps``, copied into their buffers on the way."""
        for name, tensor in weights:
            if name.endswith(XIELU_BUFFERS):
                with torch.no_grad():
                    self.get_buffer(name).copy_(tensor)
            else:
                yield name, tensor
