"""Granite 4.0 (``GraniteMoeHybridForCausalLM``: ibm-granite/granite-4.0-h-tiny / -h-small, MoE; -h-micro /
-h-1b / -h-350m, dense; granite-4.0-micro, every layer attention): Granite MoE Shared's layers
(models/granitemoe.py: Granite's four multipliers, experts weighted by the softmax of their top-k logits, the
ungated shared SwiGLU ``shared_mlp``) where ``layer_types`` makes a layer ``mamba`` (transformers:
``linear_attention``) a Mamba-2 mixer (models/mamba2_mixer.py, its fields ``mamba_*``) in place of attention,
under the name ``mamba``. ``num_local_experts`` 0 leaves each layer's shared MLP alone. The attention layers
take rotary only where ``position_embedding_type`` is ``rope`` (the -h models set ``nope``: no position
encoding at all but the Mamba layers' order)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import RMSNorm, RotaryEmbedding
from .granite import GraniteModel
from .granitemoe import GraniteMoeDecoderLayer, GraniteMoeForCausalLM
from .llama import DecoderSpec, LlamaAttention, LlamaMLP
from .mamba2_mixer import Mamba2Mixer, is_mamba_layer, mamba_fields_spec


class SharedMlpOnly(nn.Module):
    """A dense Granite 4.0 layer's MLP (``num_local_experts`` 0): the shared SwiGLU alone, under the name the
    MoE block gives it (``mlp.shared_expert``), where Granite MoE's checkpoint names lead."""

    def __init__(self, config: Any, ops: Any):
        super().__init__()
        self.shared_expert = LlamaMLP(config, ops, config.shared_intermediate_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared_expert(hidden)


class GraniteMoeHybridDecoderLayer(GraniteMoeDecoderLayer):
    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding | None):
        nn.Module.__init__(self)  # Llama's layer builds attention in every layer
        self.residual_multiplier = float(config.residual_multiplier)
        mamba = is_mamba_layer(config.layer_types, layer_index)
        self.mamba = Mamba2Mixer(mamba_fields_spec(config)) if mamba else None
        self.self_attn = None if mamba else LlamaAttention(config, ops, spec, layer_index, rotary)
        self.mlp = self.make_mlp(config, ops, spec, layer_index)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def make_mlp(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int) -> nn.Module:
        if config.num_local_experts > 0:
            return super().make_mlp(config, ops, spec, layer_index)
        return SharedMlpOnly(config, ops)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.normed_input(hidden, residual)
        mixed = self.mamba(hidden, meta) if self.mamba is not None else self.self_attn(hidden, positions, meta)
        hidden, residual = self.post_attention_layernorm(mixed * self.residual_multiplier, residual)
        return self.mlp(hidden) * self.residual_multiplier, residual


class GraniteMoeHybridModel(GraniteModel):
    layer_class = GraniteMoeHybridDecoderLayer

    def make_rotaries(self, config: Any, ops: Any) -> list[RotaryEmbedding | None]:
        if config.position_embedding_type == "rope":
            return super().make_rotaries(config, ops)
        return [None] * config.num_hidden_layers


class GraniteMoeHybridForCausalLM(GraniteMoeForCausalLM):
    model_class = GraniteMoeHybridModel
