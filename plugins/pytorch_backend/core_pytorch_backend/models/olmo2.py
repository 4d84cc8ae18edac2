"""OLMo 2 (AI2): a post-norm Llama. Each layer normalizes what its attention and its MLP return before adding
it to the residual (``post_attention_layernorm``, ``post_feedforward_layernorm``; no input norm), and q and
k are RMS-normalized over their whole projection (every head at once), before rotary."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import RMSNorm, RotaryEmbedding
from .llama import DecoderSpec, LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel


class Olmo2Attention(LlamaAttention):
    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding):
        super().__init__(config, ops, spec, layer_index, rotary)
        self.q_norm = RMSNorm(config.num_attention_heads * self.head_dim, config.rms_norm_eps, ops)
        self.k_norm = RMSNorm(config.num_key_value_heads * self.head_dim, config.rms_norm_eps, ops)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q, k = self.rotary_emb(positions, self.q_norm(q.contiguous()), self.k_norm(k.contiguous()))
        return self.o_proj(self.attn(q, k, v, meta))


class Olmo2DecoderLayer(nn.Module):
    #: The attention's class (EXAONE 4 normalizes q and k head by head).
    attention_class: type[nn.Module] = Olmo2Attention

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = self.attention_class(config, ops, spec, layer_index, rotary)
        self.mlp = self.make_mlp(config, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def make_mlp(self, config: Any, ops: Any) -> nn.Module:
        """The layer's MLP (FlexOlmo's is a mixture of experts)."""
        return LlamaMLP(config, ops)

    def forward(self, positions, hidden, residual, meta):
        """(the MLP's normalized output, the residual before it): the next layer, or the model's final norm,
        adds the two, as LlamaModel chains its layers."""
        if residual is not None:
            hidden = hidden + residual
        residual = hidden + self.post_attention_layernorm(self.self_attn(hidden, positions, meta))
        return self.post_feedforward_layernorm(self.mlp(residual)), residual


class Olmo2Model(LlamaModel):
    layer_class = Olmo2DecoderLayer


class Olmo2ForCausalLM(LlamaForCausalLM):
    model_class = Olmo2Model
    #: q and k are normalized over all heads at once, which a rank holding some of them cannot do alone
    tensor_parallel_plan = None

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderSpec(qkv_bias=bias, qk_norm=False, sliding_windows=(None,) * config.num_hidden_layers,
                           o_bias=bias)
