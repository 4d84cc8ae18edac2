"""Qwen3.5 (``Qwen3_5ForCausalLM``, ``Qwen3_5ForConditionalGeneration``: Qwen3.5-27B ...) and Qwen3.5-MoE
(``Qwen3_5MoeForCausalLM``, ``Qwen3_5MoeForConditionalGeneration``: Qwen3.5-35B-A3B, -397B-A17B), following
transformers' ``modeling_qwen3_5`` and ``modeling_qwen3_5_moe``: Qwen3-Next's layers (models/qwen3_next.py)
with the DeltaNet's projections stored apart and in order (``in_proj_qkv`` [q | k | v], ``in_proj_z``,
``in_proj_b``, ``in_proj_a``), a dense MLP in every layer (Qwen3.5) or experts with a shared expert in every
layer, always renormalized over the chosen ones (Qwen3.5-MoE, whose checkpoints stack them:
``mlp.experts.gate_up_proj`` [experts, 2 x moe_intermediate_size, hidden], ``mlp.experts.down_proj``).

The released checkpoints are vision-language ones: served here for text only, from ``text_config``, their
language model's tensors (``model.language_model.*``, which the text classes read too, as transformers'
conversion does) loaded and the vision tower (``model.visual.*``) and the multi-token-prediction head
(``mtp.*``) skipped. No vision processor is registered for them, so the engine refuses images before they
reach the backend, and the model refuses image embeddings. Their rotary is M-RoPE (``mrope_section``,
interleaved over the rotated part of each head): a text token has the same position on its three axes,
where it is the plain rotary of ``partial_rotary_factor`` of each head that this model applies to [T]
positions (transformers' ``Qwen3_5TextRotaryEmbedding`` gives the same angles)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import Linear, RotaryEmbedding
from ..layers.rotary import context_positions, rope_parameters, rotary_dim_of
from ..quant.attach import QuantizedShards
from .gated_deltanet import GatedDeltaNet
from .llama import DecoderSpec, LlamaMLP, head_dim_of
from .names import prefix_renamed
from .qwen3_next import Qwen3NextDecoderLayer, Qwen3NextForCausalLM, Qwen3NextModel
from .sparse_moe import SparseMoeBlock
from .vision_language import VisionLanguageMixin

LANGUAGE_MODEL = (("model.language_model.", "model."),)
SKIPPED_PREFIXES = ("mtp.", "model.visual.")
MROPE_KEYS = ("mrope_section", "mrope_interleaved")  # one position on every axis: plain rotary


class Qwen3_5GatedDeltaNet(GatedDeltaNet):
    def __init__(self, config: Any):
        super().__init__(config, config.rms_norm_eps)
        hidden = config.hidden_size
        self.in_proj_qkv = Linear(hidden, sum(self.sizes))
        self.in_proj_z = Linear(hidden, self.sizes[2])
        self.in_proj_b = Linear(hidden, self.value_heads)
        self.in_proj_a = Linear(hidden, self.value_heads)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return (self.in_proj_qkv(hidden), self.in_proj_z(hidden),
                self.in_proj_b(hidden), self.in_proj_a(hidden))


class Qwen3_5DecoderLayer(Qwen3NextDecoderLayer):
    mixer_class = Qwen3_5GatedDeltaNet

    def make_mlp(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int) -> nn.Module:
        return LlamaMLP(config, ops)


class Qwen3_5MoeDecoderLayer(Qwen3_5DecoderLayer):
    def make_mlp(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int) -> nn.Module:
        return SparseMoeBlock(config, ops, config.num_experts, config.num_experts_per_tok,
                              config.moe_intermediate_size, normalize=True,
                              shared_size=config.shared_expert_intermediate_size)


class Qwen3_5Model(Qwen3NextModel):
    layer_class = Qwen3_5DecoderLayer

    def make_rotaries(self, config: Any, ops: Any) -> list[RotaryEmbedding]:
        """One table of text positions: the rotary settings without their M-RoPE sections."""
        params = {key: value for key, value in rope_parameters(config).items() if key not in MROPE_KEYS}
        head_dim = head_dim_of(config)
        rotated = rotary_dim_of(config, head_dim)
        table = RotaryEmbedding(head_dim, context_positions(config), params, ops, rotated)
        return [table] * config.num_hidden_layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                embed_overrides: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if embed_overrides is not None:
            raise NotImplementedError("Qwen3.5: image and video embeddings are not supported (its language "
                                      "model is served for text only, without M-RoPE's image positions)")
        return super().forward(input_ids, positions, meta)


class Qwen3_5MoeModel(Qwen3_5Model):
    layer_class = Qwen3_5MoeDecoderLayer


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    model_class = Qwen3_5Model
    family = "Qwen3.5"

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        """``model.language_model.*`` read as ``model.*``; the vision tower and ``mtp.*`` skipped."""
        renamed = ((prefix_renamed(name, LANGUAGE_MODEL), tensor) for name, tensor in weights
                   if not name.startswith(SKIPPED_PREFIXES))
        return super().load_weights(renamed)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    model_class = Qwen3_5MoeModel
    family = "Qwen3.5-MoE"


class Qwen3_5ForConditionalGeneration(VisionLanguageMixin, Qwen3_5ForCausalLM):
    """The released Qwen3.5 checkpoints' language model (``text_config``), for text-only requests."""

    text_model_types = ("qwen3_5_text",)


class Qwen3_5MoeForConditionalGeneration(VisionLanguageMixin, Qwen3_5MoeForCausalLM):
    """The released Qwen3.5-MoE checkpoints' language model (``text_config``), for text-only requests."""

    text_model_types = ("qwen3_5_moe_text",)
