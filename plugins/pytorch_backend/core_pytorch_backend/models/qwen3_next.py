"""Qwen3-Next (``Qwen3NextForCausalLM``: Qwen3-Next-80B-A3B), following transformers' ``modeling_qwen3_next``:
a hybrid of gated DeltaNet layers (models/gated_deltanet.py) and gated full attention, by ``layer_types``
(three of every ``full_attention_interval`` = 4 layers linear by default), in Llama's pre-norm layers with
Qwen3-MoE's experts (models/sparse_moe.py) plus a shared expert behind its sigmoid gate.

- Every RMSNorm is zero-centred, ``1 + weight`` in float32 (Gemma's, models/gemma3.py): the layers', the
  final one and attention's per-head q / k norms; the DeltaNet's output norm is not (``GatedRMSNorm``).
- Attention: ``q_proj`` yields per head its query then an output gate (``2 * head_dim`` rows a head); rotary
  on the first ``partial_rotary_factor`` (0.25) of each head; the output times ``sigmoid(gate)`` before
  ``o_proj``.
- The DeltaNet's projections are stored grouped by key head: ``in_proj_qkvz`` holds, per key head, its q,
  k, and its group's v and z rows; ``in_proj_ba`` its group's b then a rows. They are put in [q | k | v | z]
  and [b | a] order at load (a permutation of rows), so the mixer splits them plainly.
- The checkpoints' multi-token-prediction weights (``mtp.*``) are skipped, as transformers skips them; the
  experts are read one by one (``mlp.experts.{e}.*``) or stacked (``mlp.experts.gate_up_proj``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import Attention, Linear, MergedLinear, RotaryEmbedding
from ..quant.attach import QuantizedShards
from .gated_deltanet import GatedDeltaNet, HybridDecoderLayer, hybrid_layer_types
from .gemma3 import GemmaRMSNorm
from .llama import DecoderSpec, LlamaForCausalLM, LlamaModel, head_dim_of
from .sparse_moe import QwenMoeDecoderLayer, experts_one_by_one, without_empty_shared_expert

SKIPPED_PREFIXES = ("mtp.",)  # the multi-token-prediction head


class Qwen3NextGatedDeltaNet(GatedDeltaNet):
    """``in_proj_qkvz`` [q | k | v | z] and ``in_proj_ba`` [b | a] (in this order after ``grouped_rows``)."""

    def __init__(self, config: Any):
        super().__init__(config, config.rms_norm_eps)
        values = self.sizes[2]
        self.in_proj_qkvz = Linear(config.hidden_size, sum(self.sizes) + values)
        self.in_proj_ba = Linear(config.hidden_size, 2 * self.value_heads)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        mixed, z = self.in_proj_qkvz(hidden).split([sum(self.sizes), self.sizes[2]], dim=-1)
        b, a = self.in_proj_ba(hidden).chunk(2, dim=-1)
        return mixed, z, b, a


class Qwen3NextAttention(nn.Module):
    """Qwen3's attention (zero-centred per-head q / k norms) with an output gate and partial rotary."""

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding):
        super().__init__()
        self.head_dim = head_dim_of(config)
        heads, kv_heads, hidden = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
        sizes = [2 * heads * self.head_dim, kv_heads * self.head_dim, kv_heads * self.head_dim]
        self.qkv_proj = MergedLinear(hidden, sizes, ("q", "k", "v"), bias=spec.qkv_bias)
        self.o_proj = Linear(heads * self.head_dim, hidden, bias=spec.o_bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, ops)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, ops)
        self.rotary_emb = rotary
        self.attn = Attention(heads, kv_heads, self.head_dim, self.head_dim**-0.5, ops, None, layer_index)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = hidden.shape[0]
        query_gate, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q, gate = query_gate.reshape(t, -1, 2 * self.head_dim).chunk(2, dim=-1)
        q, k = self.rotary_emb(positions, self.q_norm(q), self.k_norm(k.reshape(t, -1, self.head_dim)))
        out = self.attn(q.reshape(t, -1), k.reshape(t, -1), v, meta)
        return self.o_proj(out * torch.sigmoid(gate.reshape(t, -1)))


class Qwen3NextDecoderLayer(HybridDecoderLayer, QwenMoeDecoderLayer):
    """Experts and the shared expert where ``is_sparse_layer``, else a dense MLP (QwenMoeDecoderLayer's)."""

    attention_class = Qwen3NextAttention
    mixer_class = Qwen3NextGatedDeltaNet
    norm_class = GemmaRMSNorm


class Qwen3NextModel(LlamaModel):
    layer_class = Qwen3NextDecoderLayer
    partial_rotary = True

    def make_norm(self, config: Any, ops: Any) -> nn.Module:
        return GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, ops)


class Qwen3NextForCausalLM(LlamaForCausalLM):
    model_class = Qwen3NextModel
    #: recurrent layers and experts are not split across ranks
    tensor_parallel_plan = None
    #: the family's name in errors
    family = "Qwen3-Next"

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        hybrid_layer_types(config, cls.family)
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderSpec(qkv_bias=bias, qk_norm=True, sliding_windows=(None,) * config.num_hidden_layers,
                           o_bias=bias)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        kept = ((name, tensor) for name, tensor in weights if not name.startswith(SKIPPED_PREFIXES))
        kept = without_empty_shared_expert(kept, self.config)
        return super().load_weights(experts_one_by_one(grouped_projections(kept, self.config)))


def grouped_projections(weights: Iterable[tuple[str, Any]], config: Any) -> Iterator[tuple[str, Any]]:
    """``in_proj_qkvz`` and ``in_proj_ba``, rows in [q | k | v | z] and [b | a] order; the rest as is."""
    group = config.linear_num_value_heads // config.linear_num_key_heads
    qkvz = [config.linear_key_head_dim] * 2 + [group * config.linear_value_head_dim] * 2
    for name, tensor in weights:
        if name.endswith(".linear_attn.in_proj_qkvz.weight"):
            yield name, grouped_rows(name, tensor, config.linear_num_key_heads, qkvz)
        elif name.endswith(".linear_attn.in_proj_ba.weight"):
            yield name, grouped_rows(name, tensor, config.linear_num_key_heads, [group, group])
        else:
            yield name, tensor


def grouped_rows(name: str, weight: Any, groups: int, parts: list[int]) -> torch.Tensor:
    """``weight``'s rows, stored per group as [part 0 | part 1 | ...] (``parts`` rows each), as all groups'
    part 0, then all groups' part 1, ..."""
    if not isinstance(weight, torch.Tensor):
        raise NotImplementedError(f"{name}: Qwen3-Next's grouped projections from a quantized file")
    pieces = weight.reshape(groups, sum(parts), -1).split(parts, dim=1)
    return torch.cat([piece.reshape(-1, weight.shape[-1]) for piece in pieces])
