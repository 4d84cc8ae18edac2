"""DeepSeek-V2 (``DeepseekV2ForCausalLM``: DeepSeek-V2, V2-Lite, V2.5, Coder-V2) and the decoder DeepSeek-V3
(models/deepseek_v3.py) shares: Llama's pre-norm layers with multi-head latent attention (MLA) and the grouped
mixture of experts of models/grouped_router.py (V2's routing: ``greedy`` or ``group_limited_greedy``).

MLA, as transformers' ``DeepseekV2Attention``: q is ``q_proj(h)``, or ``q_b_proj(q_a_layernorm(q_a_proj(h)))``
where ``q_lora_rank`` is set; ``kv_a_proj_with_mqa(h)`` is a latent of ``kv_lora_rank`` and a rotary key part
``k_pe`` of ``qk_rope_head_dim`` that every head shares; ``kv_b_proj(kv_a_layernorm(latent))`` is each head's
``k_nope`` (``qk_nope_head_dim``) and v (``v_head_dim``). Rotary turns only the last ``qk_rope_head_dim`` values
of each q head and ``k_pe``, in pairs of adjacent values (V2 always, V3 where ``rope_interleave``): those
projection rows are put in rotate-half order at load (models/rotary_pairs.py), the same order for q and k.
The softmax scale is ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times ``mscale ** 2`` of the rope
settings' ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``); the two latent norms take eps 1e-6 whatever
``rms_norm_eps`` says, as transformers builds them.

It is served as plain multi-head attention over the expanded keys (``k_nope`` then ``k_pe``) and values
(``Attention(v_head_dim=...)``): the KV cache holds every head's expanded K and V (V zero-padded to K's width),
not the compressed latent: num_heads x (qk_nope + qk_rope) x 2 values a token and layer, against
kv_lora_rank + qk_rope_head_dim (DeepSeek-V3: 49,152 against 576)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import Attention, Linear, RMSNorm, RotaryEmbedding
from ..layers.rotary import rope_parameters, yarn_mscale
from ..quant.attach import QuantizedShards
from .grouped_router import GroupedMoeCheckpoint, GroupedMoeDecoderLayer, GroupedRouting
from .llama import DecoderSpec, LlamaForCausalLM, LlamaModel
from .rotary_pairs import Weight, rotate_half_order, rows_reordered

LATENT_NORM_EPS = 1e-6  # q_a_layernorm's and kv_a_layernorm's (transformers' RMSNorm default)
V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


def mla_softmax_scale(config: Any) -> float:
    """``qk_head_dim ** -0.5``, times YaRN's ``mscale_all_dim`` mscale squared (any rope type but the default
    one, as transformers' ``yarn_apply_mscale``)."""
    params = rope_parameters(config)
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    all_dim = params.get("mscale_all_dim")
    if params["rope_type"] != "default" and all_dim:
        mscale = yarn_mscale(params["factor"], all_dim)
        scale = scale * mscale * mscale
    return scale


class MlaAttention(nn.Module):
    """Multi-head latent attention (module docstring); ``rotary`` is a table of ``qk_rope_head_dim``."""

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding):
        super().__init__()
        self.heads = config.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.head_dim = self.nope_dim + self.rope_dim
        hidden, bias, rank = config.hidden_size, bool(config.attention_bias), config.q_lora_rank
        self.q_proj = Linear(hidden, self.heads * self.head_dim) if rank is None else None
        self.q_a_proj = Linear(hidden, rank, bias=bias) if rank is not None else None
        self.q_a_layernorm = RMSNorm(rank, LATENT_NORM_EPS, ops) if rank is not None else None
        self.q_b_proj = Linear(rank, self.heads * self.head_dim) if rank is not None else None
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS, ops)
        self.kv_b_proj = Linear(self.kv_lora_rank, self.heads * (self.nope_dim + self.v_dim))
        self.o_proj = Linear(self.heads * self.v_dim, hidden, bias=bias)
        self.rotary_emb = rotary
        self.attn = Attention(self.heads, self.heads, self.head_dim, mla_softmax_scale(config), ops,
                              layer_index=layer_index, v_head_dim=self.v_dim)

    def queries(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.q_proj is not None:
            return self.q_proj(hidden)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = hidden.shape[0]
        q = self.queries(hidden).view(t, self.heads, self.head_dim)
        latent, k_rot = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent.contiguous())).view(t, self.heads, -1)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        q_rot, k_rot = self.rotary_emb(positions, q[..., self.nope_dim:], k_rot.reshape(t, 1, self.rope_dim))
        q = torch.cat((q[..., : self.nope_dim], q_rot), dim=-1)
        k = torch.cat((k_nope, k_rot.expand(t, self.heads, self.rope_dim)), dim=-1)
        return self.o_proj(self.attn(q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1), meta))


def v2_routing(config: Any) -> GroupedRouting:
    """DeepSeek-V2's rule (``DeepseekV2TopkRouter``): softmax scores, never renormalized; groups only under
    ``group_limited_greedy``."""
    return GroupedRouting.of(config, noaux_tc=False, normalize=False,
                             grouped=config.topk_method == "group_limited_greedy")


class DeepseekV2DecoderLayer(GroupedMoeDecoderLayer):
    attention_class = MlaAttention

    def routing_rule(self, config: Any) -> GroupedRouting:
        return v2_routing(config)


class DeepseekV2Model(LlamaModel):
    layer_class = DeepseekV2DecoderLayer


class MlaCache:
    """Mixin (before ``LlamaForCausalLM`` among the bases) for MLA models' CausalLM classes: the KV cache holds
    every head's expanded K and V (module docstring)."""

    def __init__(self, config: Any, ops: Any) -> None:
        super().__init__(config, ops)
        self.num_kv_heads = config.num_attention_heads
        self.head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim


class DeepseekV2ForCausalLM(GroupedMoeCheckpoint, MlaCache, LlamaForCausalLM):
    model_class = DeepseekV2Model
    #: experts are not split across ranks, nor MLA's heads
    tensor_parallel_plan = None

    @classmethod
    def check_config(cls, config: Any) -> None:
        super().check_config(config)
        if (getattr(config, "moe_layer_freq", None) or 1) != 1:
            raise NotImplementedError(f"{cls.__name__}: moe_layer_freq {config.moe_layer_freq} is not supported "
                                      "(transformers puts experts on every layer from first_k_dense_replace on)")
        cls.check_routing(config)

    @classmethod
    def check_routing(cls, config: Any) -> None:
        """V2's router: its two topk_methods, no renormalization (transformers' ignores norm_topk_prob), and an
        MLP without biases (its experts have none)."""
        if config.topk_method not in V2_TOPK_METHODS:
            raise NotImplementedError(f"DeepseekV2: topk_method {config.topk_method!r} is not supported "
                                      f"(supported: {', '.join(V2_TOPK_METHODS)})")
        if config.norm_topk_prob:
            raise NotImplementedError("DeepseekV2: norm_topk_prob is not supported (transformers' DeepSeek-V2 "
                                      "router ignores it, DeepSeek's own code renormalizes)")
        if getattr(config, "mlp_bias", False):
            raise NotImplementedError("DeepseekV2: mlp_bias is not supported (the routed experts have no biases)")

    @classmethod
    def rope_interleaved(cls, config: Any) -> bool:
        """Whether rotary turns pairs of adjacent values (DeepSeek-V2's always do)."""
        return True

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        if self.rope_interleaved(self.config):
            weights = mla_rotary_rows_to_rotate_half(weights, self.config)
        return super().load_weights(weights)


def mla_rotary_rows_to_rotate_half(weights: Iterable[tuple[str, Weight]], config: Any
                                   ) -> Iterator[tuple[str, Weight]]:
    """The checkpoint's tensors with the rotary rows of each q head (``q_proj`` / ``q_b_proj``) and of ``k_pe``
    (``kv_a_proj_with_mqa``'s last rows, and bias) in rotate-half order."""
    nope, rope, rank = config.qk_nope_head_dim, config.qk_rope_head_dim, config.kv_lora_rank
    within = rotate_half_order(rope, rope)
    head = np.concatenate([np.arange(nope), nope + within])
    q_order = (np.arange(config.num_attention_heads)[:, None] * (nope + rope) + head[None, :]).reshape(-1)
    kv_order = np.concatenate([np.arange(rank), rank + within])
    for name, tensor in weights:
        if ".self_attn.q_proj." in name or ".self_attn.q_b_proj." in name:
            tensor = rows_reordered(tensor, q_order, name)
        elif ".self_attn.kv_a_proj_with_mqa." in name:
            tensor = rows_reordered(tensor, kv_order, name)
        yield name, tensor
