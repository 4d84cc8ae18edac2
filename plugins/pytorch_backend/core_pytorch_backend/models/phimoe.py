"""PhiMoE (Microsoft's Phi-3.5-MoE): Mixtral's layout (models/mixtral.py: ``block_sparse_moe``, experts ``w1`` /
``w3`` / ``w2``, ``sliding_window`` on every layer) with LayerNorms (weight and bias, of ``rms_norm_eps``),
biases on q/k/v/o (``attention_bias``) and on the LM head (``lm_head_bias``), and the sparsemixer router as
transformers runs it at inference: a token's first expert is its best logit, weighted by its softmax among the
logits within ``2 * router_jitter_noise`` of the best (relative to ``max(|logit|, best)``); its second is the best
of the others, weighted likewise among them. Rotary: default, or LongRoPE as transformers' PhiMoE computes it:
always its short factors, and cos/sin scaled by ``short_mscale`` (``long_mscale`` for a sequence past
``original_max_position_embeddings``, where a longer ``max_model_len`` serves every position)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..layers import LayerNorm, RotaryEmbedding
from ..layers.rotary import LONG_FACTORS_KEY, context_positions, rope_parameters, whole_head_rotary
from .llama import DecoderSpec, LlamaAttention, LlamaDecoderLayer, LlamaModel, head_dim_of
from .mixtral import MixtralForCausalLM
from .sparse_moe import SparseMoeBlock


class SparseMixerBlock(SparseMoeBlock):
    """Two experts a token, chosen and weighted by sparsemixer (the module's docstring)."""

    def __init__(self, config: Any, ops: Any) -> None:
        super().__init__(config, ops, config.num_local_experts, 2, config.intermediate_size, normalize=False)
        self.jitter_eps = config.router_jitter_noise

    def routing(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = nn.functional.linear(hidden, self.gate.weight).float()
        first_weight, first = self.masked_softmax_pick(scores, scores)
        others = scores.scatter(-1, first, float("-inf"))
        second_weight, second = self.masked_softmax_pick(scores, others)
        weights = torch.cat((first_weight, second_weight), dim=-1)
        return weights.to(hidden.dtype), torch.cat((first, second), dim=-1)

    def masked_softmax_pick(self, scores: torch.Tensor, candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the weight [T, 1], the index [T, 1]) of the best of ``candidates``: its softmax among the candidates
        within the jitter threshold of it (measured against ``scores``, as transformers does)."""
        best, index = candidates.max(dim=-1, keepdim=True)
        factor = scores.abs().clamp(min=best)
        gates = torch.softmax(candidates.masked_fill((best - scores) / factor > 2 * self.jitter_eps, float("-inf")),
                              dim=-1)
        return gates.gather(-1, index), index


class PhimoeDecoderLayer(LlamaDecoderLayer):
    """Llama's layer (its forward) with LayerNorms and sparsemixer experts."""

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding):
        nn.Module.__init__(self)  # not LlamaDecoderLayer's: its norms are RMSNorms
        self.self_attn = LlamaAttention(config, ops, spec, layer_index, rotary)
        self.mlp = SparseMixerBlock(config, ops)
        self.input_layernorm = LayerNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, config.rms_norm_eps)


class PhimoeModel(LlamaModel):
    layer_class = PhimoeDecoderLayer

    def make_rotaries(self, config: Any, ops: Any) -> list[RotaryEmbedding]:
        head_dim = head_dim_of(config)
        rotary = RotaryEmbedding(head_dim, context_positions(config), phimoe_rope_parameters(config), ops,
                                 whole_head_rotary(config, head_dim))
        return [rotary] * config.num_hidden_layers

    def make_norm(self, config: Any, ops: Any) -> nn.Module:
        return LayerNorm(config.hidden_size, config.rms_norm_eps)


def phimoe_rope_parameters(config: Any) -> dict[str, Any]:
    """The config's rope settings as transformers' PhiMoE applies them: LongRoPE's short factors at every
    position and its ``short_mscale`` (``long_mscale`` where ``serve_longrope_long`` marked the settings) as
    the attention factor."""
    params = rope_parameters(config)
    if params["rope_type"] == "default":
        return params
    if params["rope_type"] != "longrope":
        raise NotImplementedError(f"PhiMoE with rope_type {params['rope_type']!r} (rope_parameters): default and "
                                  "longrope are supported")
    mscale = params["long_mscale"] if params.get(LONG_FACTORS_KEY) else params["short_mscale"]
    return {**params, "long_factor": params["short_factor"], "attention_factor": float(mscale)}


class PhimoeForCausalLM(MixtralForCausalLM):
    model_class = PhimoeModel

    @property
    def lm_head_bias(self) -> bool:  # read by LlamaForCausalLM.__init__, after it sets self.config
        return bool(getattr(self.config, "lm_head_bias", False))

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))
        window = getattr(config, "sliding_window", None)
        return DecoderSpec(qkv_bias=bias, qk_norm=False, sliding_windows=(window,) * config.num_hidden_layers,
                           o_bias=bias)
