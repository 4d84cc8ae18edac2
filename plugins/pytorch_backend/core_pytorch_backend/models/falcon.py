"""Falcon (``FalconForCausalLM``): LayerNorms, rotary on whole heads, an ungated MLP (``dense_h_to_4h``, GELU,
``dense_4h_to_h``), ``bias`` on every projection or none, the LM head tied to ``word_embeddings``, and q/k/v
fused in ``query_key_value`` in one of three layouts: Falcon-7B's multi-query (every q head, then one k and
one v head), Falcon-40B/180B's ``new_decoder_architecture`` (per KV group: its q heads, then its k, then its v
head), or, neither, every head's q, k and v side by side. Attention and MLP read the layer's input beside each
other (``parallel_attn``: ``h + (mlp + attn)``), behind one norm (``input_layernorm``) or, in the new
architecture, two (``ln_attn`` / ``ln_mlp``, ``num_ln_in_parallel_attn`` 2, its default); else they run one
after the other (``post_attention_layernorm``). Falcon-RW's ``alibi`` layers take no rotary: ALiBi slopes
(layers/alibi.py) divided by sqrt(head_dim), as transformers adds them to the scaled scores; transformers rounds
slope * position to bfloat16 (exact below position 256 where the heads are a power of two), this model does
not. Following transformers' ``modeling_falcon``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import Attention, LayerNorm, Linear, RotaryEmbedding
from ..layers.alibi import alibi_slopes
from ..quant.attach import QuantizedShards
from .llama import DecoderSpec, LlamaForCausalLM, LlamaModel, head_dim_of, input_norm
from .names import prefix_renamed
from .ungated_mlp import UngatedMLP

RENAMED = (("transformer.word_embeddings.", "model.embed_tokens."), ("transformer.ln_f.", "model.norm."),
           ("transformer.h.", "model.layers."))


def kv_heads_of(config: Any) -> int:
    if config.new_decoder_architecture:
        return config.num_kv_heads
    return 1 if config.multi_query else config.num_attention_heads


class FalconAttention(nn.Module):
    def __init__(self, config: Any, ops: Any, layer_index: int, rotary: RotaryEmbedding):
        super().__init__()
        self.head_dim = head_dim_of(config)
        heads, self.kv_heads, hidden = config.num_attention_heads, kv_heads_of(config), config.hidden_size
        self.new_layout, self.multi_query = bool(config.new_decoder_architecture), bool(config.multi_query)
        self.query_key_value = Linear(hidden, (heads + 2 * self.kv_heads) * self.head_dim, bias=bool(config.bias))
        self.dense = Linear(hidden, hidden, bias=bool(config.bias))
        alibi = bool(getattr(config, "alibi", False))
        self.rotary_emb = None if alibi else rotary
        slopes = alibi_slopes(heads) / self.head_dim ** 0.5 if alibi else None
        self.attn = Attention(heads, self.kv_heads, self.head_dim, self.head_dim ** -0.5, ops, None, layer_index,
                              alibi_slopes=slopes)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t, d = hidden.shape[0], self.head_dim
        qkv = self.query_key_value(hidden)
        if self.new_layout:  # [kv group][its q heads, its k, its v][d]
            grouped = qkv.view(t, self.kv_heads, -1, d)
            q, k, v = grouped[:, :, :-2], grouped[:, :, -2], grouped[:, :, -1]
        elif self.multi_query:  # [q of every head | k | v]
            q, k, v = qkv.split((qkv.shape[-1] - 2 * d, d, d), dim=-1)
        else:  # [head][q, k, v][d]
            q, k, v = qkv.view(t, -1, 3, d).unbind(2)
        q, k = q.reshape(t, -1), k.reshape(t, -1)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        return self.dense(self.attn(q, k, v.reshape(t, -1), meta))


class FalconDecoderLayer(nn.Module):
    """In the Llama layers' (hidden, residual) protocol: parallel, ``mlp + attn`` is handed on beside the layer's
    input, which the next norm adds last, as transformers sums them; sequential, as Llama's layers."""

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding):
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        self.self_attention = FalconAttention(config, ops, layer_index, rotary)
        self.mlp = UngatedMLP(hidden, config.ffn_hidden_size, config.activation, ("dense_h_to_4h", "dense_4h_to_h"),
                              bias=bool(config.bias))
        self.parallel = bool(config.parallel_attn)
        self.two_norms = self.parallel and two_parallel_norms(config)
        if self.two_norms:
            self.ln_attn, self.ln_mlp = LayerNorm(hidden, eps), LayerNorm(hidden, eps)
        else:
            self.input_layernorm = LayerNorm(hidden, eps)
        if not self.parallel:
            self.post_attention_layernorm = LayerNorm(hidden, eps)

    def forward(self, positions, hidden, residual, meta):
        if self.two_norms:
            if residual is not None:
                hidden = hidden + residual
            attn = self.self_attention(self.ln_attn(hidden), positions, meta)
            return self.mlp(self.ln_mlp(hidden)) + attn, hidden
        normed, residual = input_norm(self.input_layernorm, hidden, residual)
        attn = self.self_attention(normed, positions, meta)
        if self.parallel:
            return self.mlp(normed) + attn, residual
        normed, residual = self.post_attention_layernorm(attn, residual)
        return self.mlp(normed), residual


def two_parallel_norms(config: Any) -> bool:
    """Whether parallel layers normalize attention's and MLP's inputs apart (transformers' rule)."""
    return bool(config.new_decoder_architecture) and config.num_ln_in_parallel_attn in (None, 2)


class FalconModel(LlamaModel):
    layer_class = FalconDecoderLayer

    def make_norm(self, config: Any, ops: Any) -> nn.Module:
        return LayerNorm(config.hidden_size, config.layer_norm_epsilon)


class FalconForCausalLM(LlamaForCausalLM):
    model_class = FalconModel
    #: q/k/v fused in query_key_value (per KV group in the new layout): the Llama plan's shards do not apply
    tensor_parallel_plan = None

    def __init__(self, config: Any, ops: Any):
        _refuse_unsupported(config)
        config.num_key_value_heads = kv_heads_of(config)  # what the KV cache holds
        super().__init__(config, ops)

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        bias = bool(config.bias)
        return DecoderSpec(qkv_bias=bias, qk_norm=False, sliding_windows=(None,) * config.num_hidden_layers,
                           o_bias=bias)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        return super().load_weights((_our_name(name), tensor) for name, tensor in weights)


def _refuse_unsupported(config: Any) -> None:
    """Layouts transformers does not run either (it fails on them) or that this model does not implement."""
    new, parallel = bool(config.new_decoder_architecture), bool(config.parallel_attn)
    norms = config.num_ln_in_parallel_attn
    if new and not parallel:
        raise NotImplementedError("Falcon: new_decoder_architecture with parallel_attn=False is not supported")
    if parallel and norms not in (None, 1, 2) or (parallel and not new and norms == 2):
        raise NotImplementedError(f"Falcon: num_ln_in_parallel_attn={norms} with new_decoder_architecture={new} "
                                  "is not supported")
    heads = config.num_attention_heads
    if new and heads % config.num_kv_heads:
        raise NotImplementedError(f"Falcon: num_kv_heads {config.num_kv_heads} does not divide {heads} heads")
    if not new and not config.multi_query and config.num_kv_heads != heads:
        raise NotImplementedError(f"Falcon: num_kv_heads {config.num_kv_heads} without new_decoder_architecture "
                                  "or multi_query is not supported")


def _our_name(name: str) -> str:
    return prefix_renamed(name, RENAMED)
