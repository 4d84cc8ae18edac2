"""Llama 4's text decoder (``Llama4ForCausalLM``, transformers' ``Llama4TextModel``: Scout's and Maverick's language
model). Llama's layers with, per layer (``no_rope_layers``: 1 where a layer has rotary): rotary layers turn pairs
of adjacent values (read in rotate-half order at load, models/rotary_pairs.py), normalize q and k by their RMS
without a weight after rotary (``use_qk_norm``) and attend within chunks of ``attention_chunk_size`` positions
(a query sees the keys of its own chunk up to itself, ``layer_types``' "chunked_attention"); the other (NoPE)
layers attend to everything and scale q by ``log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1``
(``attn_temperature_tuning``). The MLP of the ``moe_layers`` (every ``interleave_moe_layer_step``-th) is a shared
SwiGLU plus ``num_local_experts`` routed ones of ``intermediate_size``: a token's ``num_experts_per_tok`` best
router logits choose them and their sigmoids scale the token *before* the expert (models/sparse_moe.py's experts
weigh their outputs); the other layers' MLP is a SwiGLU of ``intermediate_size_mlp``. Checkpoints name the MLP
``feed_forward`` and the router ``router``, and keep each layer's experts stacked and transposed
(``experts.gate_up_proj`` [experts, hidden, 2 x size], gate then up; ``experts.down_proj`` [experts, size,
hidden]): read one expert at a time under SparseMoeBlock's names.

The chunked layers' attention is the reference attention's (``Attention(chunk=)``, plain torch whatever the op
set), and the native decode stack declines the model."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import Attention, RotaryEmbedding
from ..layers.norm import weightless_rms_norm
from ..native import tile_rows
from ..quant.attach import QuantizedShards
from .llama import DecoderSpec, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from .names import parts_renamed
from .rotary_pairs import pairs_to_rotate_half
from .sparse_moe import SparseMoeBlock

RENAMED = ((".feed_forward.", ".mlp."), (".mlp.router.", ".mlp.gate."))


class Llama4Attention(LlamaAttention):
    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding):
        super().__init__(config, ops, spec, layer_index, rotary)
        self.eps = config.rms_norm_eps
        self.qk_norm = bool(config.use_qk_norm) and self.rotary_emb is not None
        tuning = config.attn_temperature_tuning and self.rotary_emb is None
        self.temperature = (float(config.floor_scale), float(config.attn_scale)) if tuning else None
        if config.layer_types[layer_index] == "chunked_attention":
            attn = self.attn
            self.attn = Attention(attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale, ops, None, layer_index,
                                  chunk=config.attention_chunk_size)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        t = q.shape[0]
        q, k = q.reshape(t, -1, self.head_dim), k.reshape(t, -1, self.head_dim)
        if self.qk_norm:
            q, k = weightless_rms_norm(q, self.eps), weightless_rms_norm(k, self.eps)
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
            q = (q * scales[:, None, None]).to(q.dtype)
        return self.o_proj(self.attn(q.reshape(t, -1), k.reshape(t, -1), v, meta))


class Llama4MoeBlock(SparseMoeBlock):
    """The shared expert plus the routed ones, each token scaled by its routers' sigmoids before the expert."""

    def __init__(self, config: Any, ops: Any) -> None:
        super().__init__(config, ops, config.num_local_experts, config.num_experts_per_tok, config.intermediate_size,
                         normalize=False, shared_size=config.intermediate_size, shared_gate=False)

    def routing(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        best, chosen = torch.topk(nn.functional.linear(hidden, self.gate.weight), self.top_k, dim=-1)
        return torch.sigmoid(best.float()).to(hidden.dtype), chosen

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.routing(hidden)
        routed = torch.zeros_like(hidden)
        for expert in torch.unique(chosen).tolist():  # ascending
            tokens, slot = torch.where(chosen == expert)
            with tile_rows.gathered(tokens, hidden.shape[0]):  # each token's row on its own loop, as in the step
                routed.index_add_(0, tokens, self.experts[expert](hidden[tokens] * weights[tokens, slot, None]))
        return self.shared_expert(hidden) + routed


class Llama4DecoderLayer(LlamaDecoderLayer):
    attention_class = Llama4Attention

    def make_mlp(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int) -> nn.Module:
        if layer_index in config.moe_layers:
            return Llama4MoeBlock(config, ops)
        return LlamaMLP(config, ops, config.intermediate_size_mlp)


class Llama4Model(LlamaModel):
    layer_class = Llama4DecoderLayer


class Llama4ForCausalLM(LlamaForCausalLM):
    model_class = Llama4Model
    #: experts are not split across ranks
    tensor_parallel_plan = None

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))
        rope = tuple(bool(config.no_rope_layers[i]) for i in range(config.num_hidden_layers))
        return DecoderSpec(qkv_bias=bias, qk_norm=False, sliding_windows=(None,) * config.num_hidden_layers,
                           o_bias=bias, rope_layers=rope)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        return super().load_weights(pairs_to_rotate_half(_experts_one_by_one(weights), self.config))


def _experts_one_by_one(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors under SparseMoeBlock's names, its stacked experts one expert at a time."""
    for name, tensor in weights:
        name = parts_renamed(name, RENAMED)
        if not name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            yield name, tensor
            continue
        if not isinstance(tensor, torch.Tensor):
            raise NotImplementedError(f"{name}: Llama 4's stacked experts from a quantized file")
        prefix, projection = name.rsplit(".", 1)
        for expert, weight in enumerate(tensor.transpose(1, 2)):  # [out, in] each
            if projection == "down_proj":
                yield f"{prefix}.{expert}.down_proj.weight", weight
            else:
                gate, up = weight.chunk(2, dim=0)
                yield f"{prefix}.{expert}.gate_proj.weight", gate
                yield f"{prefix}.{expert}.up_proj.weight", up
