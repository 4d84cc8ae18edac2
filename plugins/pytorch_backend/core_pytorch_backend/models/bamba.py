"""Bamba (``BambaForCausalLM``: ibm-ai-platform/Bamba-9B-v1 / -v2): Llama's pre-norm layers where each layer's
token mixer is either the Mamba-2 mixer (models/mamba2_mixer.py, fields ``mamba_*``, under the name ``mamba``)
or, on the layers ``attn_layer_indices`` lists, Llama's attention with rotary on the first half of each head
(transformers fixes ``partial_rotary_factor`` at 0.5 for Bamba, whatever the config says). Then a SwiGLU MLP
(``feed_forward``, behind ``pre_ff_layernorm``) and a final ``final_layernorm``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import RMSNorm, RotaryEmbedding
from ..quant.attach import QuantizedShards
from .llama import DecoderSpec, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from .mamba2_mixer import Mamba2Mixer, is_mamba_layer, mamba_fields_spec
from .names import prefix_renamed

RENAMED = (("model.final_layernorm.", "model.norm."),)


class BambaDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding):
        nn.Module.__init__(self)  # Llama's layer builds attention in every layer
        mamba = is_mamba_layer(config.layers_block_type, layer_index, "attn_layer_indices")
        self.mamba = Mamba2Mixer(mamba_fields_spec(config)) if mamba else None
        self.self_attn = None if mamba else LlamaAttention(config, ops, spec, layer_index, rotary)
        self.feed_forward = LlamaMLP(config, ops, bias=spec.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.normed_input(hidden, residual)
        mixed = self.mamba(hidden, meta) if self.mamba is not None else self.self_attn(hidden, positions, meta)
        hidden, residual = self.pre_ff_layernorm(mixed, residual)
        return self.feed_forward(hidden), residual


class BambaModel(LlamaModel):
    layer_class = BambaDecoderLayer
    partial_rotary = True


class BambaForCausalLM(LlamaForCausalLM):
    model_class = BambaModel
    tensor_parallel_plan = None

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        return super().load_weights((prefix_renamed(name, RENAMED), tensor) for name, tensor in weights)
