"""AFMoE (``AfmoeForCausalLM``: Arcee's Trinity): Llama's attention with q and k RMS-normalized head by head, rotary
and a window on the layers ``layer_types`` names "sliding_attention" (the global ones take neither), and the output
gated by ``sigmoid(gate_proj(h))`` before ``o_proj``; layers of four norms (before and after the attention and the
MLP, as Gemma's); the first ``num_dense_layers`` MLPs dense, the others DeepSeek-V3's ``noaux_tc`` experts
(models/grouped_router.py, one group): sigmoid scores, chosen with the ``expert_bias`` added, the chosen scores
divided by their sum (+ 1e-20) and times ``route_scale``, beside a shared MLP ``num_shared_experts`` experts wide.
The embeddings are times ``sqrt(hidden_size)`` where ``mup_enabled``. Every norm multiplies its weight in float32
(gpt-oss's ``GptOssRMSNorm``), as transformers keeps them; the router's weight stays float32 as the grouped block
keeps it (transformers keeps AFMoE's ``expert_bias`` alone so: its bfloat16 logits round once more). Following
transformers' ``modeling_afmoe``."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import Linear, RotaryEmbedding
from ..quant.attach import QuantizedShards
from .gpt_oss import GptOssRMSNorm
from .grouped_router import GroupedMoeBlock, GroupedMoeCheckpoint, GroupedRouting
from .llama import (
    DecoderSpec,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    layer_types_of,
    layer_types_windows,
)
from .names import parts_renamed

RENAMED = ((".mlp.router.gate.", ".mlp.gate."), (".mlp.expert_bias", ".mlp.gate.e_score_correction_bias"))


class AfmoeAttention(LlamaAttention):
    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding):
        super().__init__(config, ops, spec, layer_index, rotary)
        self.q_norm = GptOssRMSNorm(self.head_dim, config.rms_norm_eps, ops)
        self.k_norm = GptOssRMSNorm(self.head_dim, config.rms_norm_eps, ops)
        self.gate_proj = Linear(config.hidden_size, config.num_attention_heads * self.head_dim)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        gate = torch.sigmoid(self.gate_proj(hidden))
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        t = q.shape[0]
        q = self.q_norm(q.reshape(t, -1, self.head_dim)).reshape(t, -1)
        k = self.k_norm(k.reshape(t, -1, self.head_dim)).reshape(t, -1)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta) * gate)


def afmoe_routing(config: Any) -> GroupedRouting:
    """DeepSeek-V3's ``noaux_tc`` on one group: sigmoid scores chosen with ``expert_bias`` added, renormalized,
    times ``route_scale`` (transformers' ``AfmoeTokenChoiceRouter``)."""
    rule = GroupedRouting(config.num_experts_per_tok, 1, 1, noaux_tc=True, normalize=True,
                          scaling=float(config.route_scale))
    rule.check(config.num_experts)
    return rule


class AfmoeDecoderLayer(nn.Module):
    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = AfmoeAttention(config, ops, spec, layer_index, rotary)
        dense = layer_index < config.num_dense_layers
        self.mlp = LlamaMLP(config, ops) if dense else GroupedMoeBlock(config, ops, afmoe_routing(config))
        norms = ("input_layernorm", "post_attention_layernorm", "pre_mlp_layernorm", "post_mlp_layernorm")
        for name in norms:
            setattr(self, name, GptOssRMSNorm(config.hidden_size, config.rms_norm_eps, ops))

    def forward(self, positions, hidden, residual, meta):
        """(the MLP's normalized output, the residual before it): the next layer, or the final norm, adds them."""
        if residual is not None:
            hidden = hidden + residual
        attended = self.self_attn(self.input_layernorm(hidden), positions, meta)
        residual = hidden + self.post_attention_layernorm(attended)
        return self.post_mlp_layernorm(self.mlp(self.pre_mlp_layernorm(residual))), residual


class AfmoeModel(LlamaModel):
    layer_class = AfmoeDecoderLayer

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec) -> None:
        super().__init__(config, ops, spec)
        self.embedding_scale = math.sqrt(config.hidden_size) if config.mup_enabled else None

    def make_norm(self, config: Any, ops: Any) -> nn.Module:
        return GptOssRMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        return hidden if self.embedding_scale is None else hidden * self.embedding_scale


class AfmoeForCausalLM(GroupedMoeCheckpoint, LlamaForCausalLM):
    model_class = AfmoeModel
    #: per-head q/k norms and experts are not split across ranks
    tensor_parallel_plan = None

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        bias = bool(config.attention_bias)
        return DecoderSpec(qkv_bias=bias, o_bias=bias, qk_norm=False, sliding_windows=layer_types_windows(config),
                           rope_layers=tuple(t == "sliding_attention" for t in layer_types_of(config)))

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        return super().load_weights((parts_renamed(name, RENAMED), tensor) for name, tensor in weights)
