"""GPT-NeoX (``GPTNeoXForCausalLM``: Pythia, GPT-NeoX-20B): LayerNorms with biases, q/k/v fused head by head
(``query_key_value``: each head's q, k and v side by side), rotary on the first ``partial_rotary_factor`` of
each head (a quarter in the released checkpoints), an ungated MLP (``dense_h_to_4h``, GELU, ``dense_4h_to_h``)
and, where ``use_parallel_residual`` (the default), attention and MLP beside each other, each behind its own
norm of the layer's input: ``h + attn(ln1(h)) + mlp(ln2(h))``. Following transformers' ``modeling_gpt_neox``;
the checkpoints' names (``gpt_neox.embed_in``, ``attention``, ``final_layer_norm``, ``embed_out``) are read
as this model's."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import Attention, LayerNorm, Linear, RotaryEmbedding
from ..quant.attach import QuantizedShards
from .llama import DecoderSpec, LayerNormModel, LlamaForCausalLM, head_dim_of
from .names import parts_renamed
from .ungated_mlp import UngatedMLP

RENAMED = (("gpt_neox.embed_in.", "model.embed_tokens."), ("gpt_neox.final_layer_norm.", "model.norm."),
           ("gpt_neox.layers.", "model.layers."), (".attention.", ".self_attn."), ("embed_out.", "lm_head."))
#: buffers of older checkpoints (the causal mask, its fill value) that are not weights
SKIPPED = (".attention.bias", ".attention.masked_bias")


class GPTNeoXAttention(nn.Module):
    def __init__(self, config: Any, ops: Any, layer_index: int, rotary: RotaryEmbedding):
        super().__init__()
        self.head_dim = head_dim_of(config)
        heads, hidden = config.num_attention_heads, config.hidden_size
        bias = bool(getattr(config, "attention_bias", True))  # Persimmon's config has no field: biases always
        self.query_key_value = Linear(hidden, 3 * heads * self.head_dim, bias=bias)
        self.dense = Linear(heads * self.head_dim, hidden, bias=bias)
        # Persimmon's qk_layernorm: one LayerNorm of a head's width for every head of q, another for k
        qk_norm = getattr(config, "qk_layernorm", False)
        self.q_layernorm = LayerNorm(self.head_dim, config.layer_norm_eps) if qk_norm else None
        self.k_layernorm = LayerNorm(self.head_dim, config.layer_norm_eps) if qk_norm else None
        self.rotary_emb = rotary
        self.attn = Attention(heads, heads, self.head_dim, self.head_dim ** -0.5, ops, None, layer_index)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = hidden.shape[0]
        q, k, v = self.query_key_value(hidden).view(t, -1, 3 * self.head_dim).chunk(3, dim=-1)
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q, k = self.rotary_emb(positions, q.contiguous(), k.contiguous())
        return self.dense(self.attn(q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1), meta))


class GPTNeoXLayer(nn.Module):
    """In the Llama layers' (hidden, residual) protocol, with transformers' order of the sums: parallel,
    (mlp + attn) is handed on beside the layer's input, which the next norm adds last; sequential, as Llama."""

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = GPTNeoXAttention(config, ops, layer_index, rotary)
        self.mlp = UngatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                              ("dense_h_to_4h", "dense_4h_to_h"))
        self.input_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.parallel = bool(getattr(config, "use_parallel_residual", False))  # Persimmon's: sequential

    def forward(self, positions, hidden, residual, meta):
        if residual is not None:
            hidden = hidden + residual
        attn = self.self_attn(self.input_layernorm(hidden), positions, meta)
        if self.parallel:
            return self.mlp(self.post_attention_layernorm(hidden)) + attn, hidden
        normed, residual = self.post_attention_layernorm(attn, hidden)
        return self.mlp(normed), residual


class GPTNeoXModel(LayerNormModel):
    layer_class = GPTNeoXLayer
    partial_rotary = True


class GPTNeoXForCausalLM(LlamaForCausalLM):
    model_class = GPTNeoXModel
    tensor_parallel_plan = None  # q/k/v fused head by head: the Llama plan's shards do not apply

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        return DecoderSpec(qkv_bias=True, qk_norm=False, sliding_windows=(None,) * config.num_hidden_layers)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        return super().load_weights((_our_name(name), tensor) for name, tensor in weights
                                    if not name.endswith(SKIPPED))


def _our_name(name: str) -> str:
    return parts_renamed(name, RENAMED)
