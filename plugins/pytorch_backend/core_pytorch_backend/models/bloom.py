"""BLOOM (``BloomForCausalLM``: bigscience/bloom-560m to bloom, the bloomz fine-tunes): no position embeddings
but ALiBi, each head's attention scores biased by ``slope * (j - i)`` for key j and query i
(``AlibiAttention``, which MPT's attention extends), with transformers' slopes (``layers.alibi``); a LayerNorm
on the token embeddings (``word_embeddings_layernorm``); pre-norm layers of LayerNorms, biases on every
projection, an ungated MLP (``dense_h_to_4h``, Bloom's tanh GELU, ``dense_4h_to_h``), the LM head tied to
``word_embeddings``. Where ``apply_residual_connection_post_layernorm``, each residual branch adds onto its
norm's output instead of the norm's input. q/k/v are fused in ``query_key_value`` head by head (rows [heads,
3, head_dim]); those rows are put in the q | k | v order of Llama's ``qkv_proj`` at load (whatever form the
weight comes in: ``rotary_pairs.rows_reordered``). bloom-560m's files name the tensors without the
``transformer.`` that the others put in front; both are read. Following transformers' ``modeling_bloom``."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from ..layers import Attention, LayerNorm, RotaryEmbedding
from ..layers.alibi import alibi_slopes
from ..quant.attach import QuantizedShards
from .llama import DecoderSpec, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, input_norm
from .names import parts_renamed, prefix_renamed
from .rotary_pairs import Weight, rows_reordered
from .ungated_mlp import UngatedMLP

PREFIX = "transformer."
RENAMED = (("word_embeddings.", "model.embed_tokens."), ("word_embeddings_layernorm.", "model.embed_norm."),
           ("ln_f.", "model.norm."), ("h.", "model.layers."))
IN_LAYER = ((".self_attention.query_key_value.", ".self_attn.qkv_proj."),
            (".self_attention.dense.", ".self_attn.o_proj."))
FUSED_QKV = ".self_attn.qkv_proj."


class AlibiAttention(LlamaAttention):
    """Llama's attention without rotary, ALiBi's per-head bias on its scores (after the softmax scale, as
    transformers adds it); ``slopes`` gives each head's slope (Bloom's rule here, MPT's in ``models.mpt``)."""

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int,
                 rotary: RotaryEmbedding | None) -> None:
        super().__init__(config, ops, spec, layer_index, None)
        plain = self.attn
        self.attn = Attention(plain.num_heads, plain.num_kv_heads, plain.head_dim, plain.scale, ops,
                              plain.sliding_window, layer_index, alibi_slopes=self.slopes(config))

    @staticmethod
    def slopes(config: Any) -> torch.Tensor:
        return alibi_slopes(config.num_attention_heads)


class BloomDecoderLayer(LlamaDecoderLayer):
    """Llama's layer (its forward) with LayerNorms, the ALiBi attention and Bloom's MLP; or, where
    ``apply_residual_connection_post_layernorm``, the norms' outputs as the residuals."""

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int,
                 rotary: RotaryEmbedding | None) -> None:
        nn.Module.__init__(self)  # not LlamaDecoderLayer's: its norms are RMSNorms, its MLP gated
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        self.self_attn = AlibiAttention(config, ops, spec, layer_index, rotary)
        self.mlp = UngatedMLP(hidden, 4 * hidden, "bloom_gelu", ("dense_h_to_4h", "dense_4h_to_h"))
        self.input_layernorm = LayerNorm(hidden, eps)
        self.post_attention_layernorm = LayerNorm(hidden, eps)
        self.residual_after_norm = bool(config.apply_residual_connection_post_layernorm)

    def forward(self, positions, hidden, residual, meta):
        if not self.residual_after_norm:
            return super().forward(positions, hidden, residual, meta)
        normed, _ = input_norm(self.input_layernorm, hidden, residual)
        normed, _ = self.post_attention_layernorm(self.self_attn(normed, positions, meta), normed)
        return self.mlp(normed), normed  # the next norm adds them: mlp(n2) + n2


class AlibiModel(LlamaModel):
    """A LlamaModel of LayerNorms (``layer_norm_epsilon``) whose layers take no rotary table (ALiBi's)."""

    def make_rotaries(self, config: Any, ops: Any) -> list[None]:
        return [None] * config.num_hidden_layers

    def make_norm(self, config: Any, ops: Any) -> nn.Module:
        return LayerNorm(config.hidden_size, config.layer_norm_epsilon)


class BloomModel(AlibiModel):
    layer_class = BloomDecoderLayer

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec):
        super().__init__(config, ops, spec)
        self.embed_norm = LayerNorm(config.hidden_size, config.layer_norm_epsilon)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_norm(self.embed_tokens(input_ids))


class BloomForCausalLM(LlamaForCausalLM):
    model_class = BloomModel
    tensor_parallel_plan = None  # q/k/v fused head by head and one ALiBi slope per head: not sharded

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        return DecoderSpec(qkv_bias=True, qk_norm=False, sliding_windows=(None,) * config.num_hidden_layers,
                           o_bias=True)

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> QuantizedShards:
        heads = self.config.num_attention_heads
        return super().load_weights(_ours(weights, qkv_order(heads, self.config.hidden_size // heads)))


def qkv_order(heads: int, head_dim: int) -> np.ndarray:
    """The fused rows [heads, 3, head_dim] in q | k | v order: every head's q rows, then k's, then v's."""
    return np.arange(heads * 3 * head_dim).reshape(heads, 3, head_dim).transpose(1, 0, 2).reshape(-1)


def _ours(weights: Iterable[tuple[str, Weight]], order: np.ndarray) -> Iterator[tuple[str, Weight]]:
    for name, tensor in weights:
        name = _our_name(name)
        yield name, rows_reordered(tensor, order, name) if FUSED_QKV in name else tensor


def _our_name(name: str) -> str:
    return parts_renamed(prefix_renamed(name.removeprefix(PREFIX), RENAMED), IN_LAYER)
