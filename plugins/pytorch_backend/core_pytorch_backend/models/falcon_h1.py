"""Falcon-H1 (``FalconH1ForCausalLM``: tiiuae/Falcon-H1-0.5B ... -34B, -1.5B-Deep): every layer runs the
Mamba-2 mixer (models/mamba2_mixer.py) and Llama's attention side by side on the same normed input and adds
both to the residual, then a SwiGLU MLP (``feed_forward`` behind ``pre_ff_layernorm``), with muP multipliers:
the embeddings times ``embedding_multiplier``; the mixer's input times ``ssm_in_multiplier``, its projection's
five parts (z, x, B, C, dt) times ``ssm_multipliers`` (transformers' ``mup_vector``), its output times
``ssm_out_multiplier``; the attention's input times ``attention_in_multiplier``, its keys (before rotary) times
``key_multiplier``, its output times ``attention_out_multiplier``; the MLP's gate times ``mlp_multipliers[0]``
before the activation and its output times ``mlp_multipliers[1]``; the logits times ``lm_head_multiplier``.
The mixer's width is ``mamba_d_ssm`` (else ``mamba_expand * hidden_size``), its gated norm optional
(``mamba_rms_norm``; else ``y * silu(z)``) and normed before the gate where ``mamba_norm_before_gate``; its
out_proj is biased by ``projectors_bias``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import Activation, RMSNorm, RotaryEmbedding
from ..quant.attach import QuantizedShards
from .bamba import RENAMED
from .llama import DecoderSpec, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from .mamba2_mixer import Mamba2Mixer, MixerSpec, mamba_fields_spec
from .names import prefix_renamed


class FalconH1Mixer(Mamba2Mixer):
    """The mixer with Falcon-H1's input multiplier and per-part projection multipliers."""

    def __init__(self, spec: MixerSpec, in_multiplier: float, part_multipliers: list[float]):
        super().__init__(spec)
        self.in_multiplier = float(in_multiplier)
        self.part_multipliers = [float(m) for m in part_multipliers]
        bc = spec.groups * spec.state_size
        self.part_sizes = [spec.inner, spec.inner, bc, bc, spec.heads]

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        parts = self.in_proj(hidden * self.in_multiplier).split(self.part_sizes, dim=-1)
        return torch.cat([part * m for part, m in zip(parts, self.part_multipliers, strict=True)], dim=-1)


class FalconH1Attention(LlamaAttention):
    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding):
        super().__init__(config, ops, spec, layer_index, rotary)
        self.key_multiplier = float(config.key_multiplier)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q, k = self.rotary_emb(positions, q, k * self.key_multiplier)
        return self.o_proj(self.attn(q, k, v, meta))


class FalconH1MLP(LlamaMLP):
    def __init__(self, config: Any, ops: Any):
        super().__init__(config, ops, bias=bool(config.mlp_bias))
        self.act = Activation(config.hidden_act)
        self.gate_multiplier, self.down_multiplier = (float(m) for m in config.mlp_multipliers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(up * self.act(gate * self.gate_multiplier)) * self.down_multiplier


def mixer_spec(config: Any) -> MixerSpec:
    return mamba_fields_spec(config, inner=config.mamba_d_ssm, out_bias=bool(config.projectors_bias),
                             gated_norm=bool(config.mamba_rms_norm),
                             norm_before_gate=bool(config.mamba_norm_before_gate))


class FalconH1DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding):
        nn.Module.__init__(self)  # Llama's layer has no mixer and other names
        self.mamba = FalconH1Mixer(mixer_spec(config), config.ssm_in_multiplier, config.ssm_multipliers)
        self.self_attn = FalconH1Attention(config, ops, spec, layer_index, rotary)
        self.feed_forward = FalconH1MLP(config, ops)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.ssm_out_multiplier = float(config.ssm_out_multiplier)
        self.attention_in_multiplier = float(config.attention_in_multiplier)
        self.attention_out_multiplier = float(config.attention_out_multiplier)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.normed_input(hidden, residual)
        mamba = self.mamba(hidden, meta) * self.ssm_out_multiplier
        attention = self.self_attn(hidden * self.attention_in_multiplier, positions, meta)
        hidden, residual = self.pre_ff_layernorm(mamba + attention * self.attention_out_multiplier, residual)
        return self.feed_forward(hidden), residual


class FalconH1Model(LlamaModel):
    layer_class = FalconH1DecoderLayer

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec):
        super().__init__(config, ops, spec)
        self.embedding_multiplier = float(config.embedding_multiplier)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier


class FalconH1ForCausalLM(LlamaForCausalLM):
    model_class = FalconH1Model
    tensor_parallel_plan = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) * self.config.lm_head_multiplier

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        return super().load_weights((prefix_renamed(name, RENAMED), tensor) for name, tensor in weights)
