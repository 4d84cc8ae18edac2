"""Jamba (``JambaForCausalLM``: ai21labs/Jamba-v0.1, AI21-Jamba-1.5-Mini / Large and later): pre-norm
layers whose mixer is attention in every layer ``i`` with ``i % attn_layer_period == attn_layer_offset``
(Llama's attention without rotary, no biases, in the paged KV cache) and a Mamba-1 mixer elsewhere
(models/mamba_mixer.py, its time step, B and C RMS-normalized with weights), and whose feed-forward is, where
``i % expert_layer_period == expert_layer_offset`` and ``num_experts`` > 1, a sparse mixture of
``num_experts`` SwiGLU experts of ``intermediate_size`` (models/sparse_moe.py: the softmax's top
``num_experts_per_tok``, not renormalized), a SwiGLU MLP of that size elsewhere. Checkpoint names:
``self_attn.{q,k,v,o}_proj`` or ``mamba.*``, ``feed_forward.router`` (read as the expert block's ``gate``) and
``feed_forward.experts.{e}.*_proj`` or ``feed_forward.*_proj``, ``input_layernorm``, ``pre_ff_layernorm``,
``model.final_layernorm`` (read as ``model.norm``). Following transformers' ``modeling_jamba``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import RMSNorm
from ..quant.attach import QuantizedShards
from .llama import DecoderSpec, LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel, input_norm
from .mamba_mixer import JambaMambaMixer, MixerSizes
from .names import parts_renamed
from .sparse_moe import SparseMoeBlock

RENAMED = ((".feed_forward.router.", ".feed_forward.gate."), ("model.final_layernorm.", "model.norm."))


def is_attention_layer(config: Any, index: int) -> bool:
    return index % config.attn_layer_period == config.attn_layer_offset


def has_experts(config: Any, index: int) -> bool:
    return config.num_experts > 1 and index % config.expert_layer_period == config.expert_layer_offset


def mixer_sizes(config: Any) -> MixerSizes:
    """A Jamba config's Mamba mixer."""
    return MixerSizes(config.hidden_size, config.mamba_expand * config.hidden_size, config.mamba_d_state,
                      config.mamba_d_conv, int(config.mamba_dt_rank), bool(config.mamba_proj_bias),
                      bool(config.mamba_conv_bias), config.hidden_act)


class JambaDecoderLayer(nn.Module):
    """Attention or a Mamba mixer, then experts or a dense MLP, each behind its RMSNorm, in the decoders'
    (hidden, residual) protocol."""

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: Any):
        super().__init__()
        self.attention = is_attention_layer(config, layer_index)
        if self.attention:
            self.self_attn = LlamaAttention(config, ops, spec, layer_index, rotary)
        else:
            self.mamba = JambaMambaMixer(mixer_sizes(config), ops, config.rms_norm_eps)
        if has_experts(config, layer_index):
            self.feed_forward = SparseMoeBlock(config, ops, config.num_experts, config.num_experts_per_tok,
                                               config.intermediate_size, normalize=False)
        else:
            self.feed_forward = LlamaMLP(config, ops)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = input_norm(self.input_layernorm, hidden, residual)
        if self.attention:
            hidden = self.self_attn(hidden, positions, meta)
        else:
            hidden = self.mamba(hidden, meta)
        hidden, residual = self.pre_ff_layernorm(hidden, residual)
        return self.feed_forward(hidden), residual


class JambaModel(LlamaModel):
    layer_class = JambaDecoderLayer

    def make_rotaries(self, config: Any, ops: Any) -> list[None]:
        """None: Jamba's attention has no position encoding (its Mamba layers order the tokens)."""
        return [None] * config.num_hidden_layers


class JambaForCausalLM(LlamaForCausalLM):
    model_class = JambaModel
    #: Mamba layers and experts are not split across ranks
    tensor_parallel_plan = None

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        layers = config.num_hidden_layers
        return DecoderSpec(qkv_bias=False, qk_norm=False, sliding_windows=(None,) * layers,
                           rope_layers=(False,) * layers)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        return super().load_weights((parts_renamed(name, RENAMED), tensor) for name, tensor in weights)
