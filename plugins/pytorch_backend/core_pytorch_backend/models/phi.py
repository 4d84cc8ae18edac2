"""Phi (``PhiForCausalLM``: phi-1, phi-1.5, phi-2): one LayerNorm a layer, whose output both the attention and an
ungated MLP (``fc1``, GELU, ``fc2``) read beside each other (``h + (attn + mlp)``), q/k/v and the output
projection (``dense``) with biases, optionally a LayerNorm on each head of q and k (``qk_layernorm``), rotary
on the first ``partial_rotary_factor`` of each head (0.4 for phi-2), a final LayerNorm (``final_layernorm``)
and an LM head with a bias. Following transformers' ``modeling_phi``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import Attention, LayerNorm, Linear, QKVLinear, RotaryEmbedding
from ..quant.attach import QuantizedShards
from .llama import DecoderSpec, LayerNormModel, LlamaForCausalLM, head_dim_of, input_norm
from .ungated_mlp import UngatedMLP


class PhiAttention(nn.Module):
    def __init__(self, config: Any, ops: Any, layer_index: int, rotary: RotaryEmbedding):
        super().__init__()
        self.head_dim = head_dim_of(config)
        heads, kv_heads, hidden = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
        self.qkv_proj = QKVLinear(hidden, self.head_dim, heads, kv_heads, bias=True)
        self.dense = Linear(heads * self.head_dim, hidden, bias=True)
        self.q_layernorm = self.k_layernorm = None
        if getattr(config, "qk_layernorm", False):  # one norm over each head's width, shared by the heads
            self.q_layernorm = nn.LayerNorm(self.head_dim, eps=config.layer_norm_eps)
            self.k_layernorm = nn.LayerNorm(self.head_dim, eps=config.layer_norm_eps)
        self.rotary_emb = rotary
        self.attn = Attention(heads, kv_heads, self.head_dim, self.head_dim ** -0.5, ops, None, layer_index)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        if self.q_layernorm is not None:
            t = q.shape[0]
            q = self.q_layernorm(q.reshape(t, -1, self.head_dim)).reshape(t, -1)
            k = self.k_layernorm(k.reshape(t, -1, self.head_dim)).reshape(t, -1)
        q, k = self.rotary_emb(positions, q, k)
        return self.dense(self.attn(q, k, v, meta))


class PhiDecoderLayer(nn.Module):
    """In the Llama layers' (hidden, residual) protocol: ``attn + mlp`` is handed on beside the layer's input,
    which the next norm adds last, as transformers sums them."""

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = PhiAttention(config, ops, layer_index, rotary)
        self.mlp = UngatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, ("fc1", "fc2"), ops=ops)
        self.input_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps, ops=ops)

    def forward(self, positions, hidden, residual, meta):
        normed, residual = input_norm(self.input_layernorm, hidden, residual)
        return self.self_attn(normed, positions, meta) + self.mlp(normed), residual


class PhiModel(LayerNormModel):
    layer_class = PhiDecoderLayer
    partial_rotary = True


class PhiForCausalLM(LlamaForCausalLM):
    model_class = PhiModel
    lm_head_bias = True
    tensor_parallel_plan = None  # its projections are named dense / fc1 / fc2, which the Llama plan does not shard

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        return DecoderSpec(qkv_bias=True, qk_norm=False, sliding_windows=(None,) * config.num_hidden_layers)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        return super().load_weights((name.replace("model.final_layernorm.", "model.norm."), tensor)
                                    for name, tensor in weights)
