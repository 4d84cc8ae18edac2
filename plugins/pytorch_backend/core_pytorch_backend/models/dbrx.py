"""DBRX (``DbrxForCausalLM``, Databricks): pre-norm layers of bias-free LayerNorms (eps 1e-5), grouped-query
attention from one fused ``Wqkv`` projection whose output is clamped to +-``clip_qkv`` before it is split, rotary
(rotate-half) over whole heads, and a mixture of ``moe_num_experts`` SwiGLU experts of ``ffn_hidden_size`` in every
layer: each token through the ``moe_top_k`` best of the router's softmax probabilities, divided by their
``moe_normalize_expert_weights``-norm (1: their sum) where that is set. Following transformers' ``modeling_dbrx``.

The checkpoints hold each layer's experts stacked (``ffn.experts.mlp.w1`` / ``v1`` / ``w2``, each
[experts x ffn_hidden_size, hidden], w2 transposed against a ``down_proj``): read one expert at a time under the
names the other MoE models use. Rotary takes ``attn_config.rope_theta`` (the checkpoints' field: 500,000 in
DBRX's), which transformers 5 leaves unread, rotating by its top-level ``rope_parameters`` (10,000 unless set)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import LayerNorm, RotaryEmbedding
from ..quant.attach import QuantizedShards
from .llama import DecoderSpec, LlamaAttention, LlamaForCausalLM, LlamaModel, input_norm
from .names import parts_renamed
from .sparse_moe import SparseMoeBlock

NORM_EPS = 1e-5  # nn.LayerNorm's default, which transformers' DBRX keeps
RENAMED = (("transformer.wte.", "model.embed_tokens."), ("transformer.norm_f.", "model.norm."),
           ("transformer.blocks.", "model.layers."), (".norm_attn_norm.norm_1.", ".input_layernorm."),
           (".norm_attn_norm.norm_2.", ".post_attention_layernorm."),
           (".norm_attn_norm.attn.Wqkv.", ".self_attn.qkv_proj."),
           (".norm_attn_norm.attn.out_proj.", ".self_attn.o_proj."), (".ffn.router.layer.", ".mlp.gate."))
STACKED = {"w1": "gate_proj", "v1": "up_proj", "w2": "down_proj"}


class DbrxAttention(LlamaAttention):
    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding):
        super().__init__(config, ops, spec, layer_index, rotary)
        self.clip_qkv = config.attn_config.clip_qkv

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(-self.clip_qkv, self.clip_qkv)
        q, k, v = self.qkv_proj.split(qkv)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta))


class DbrxMoeBlock(SparseMoeBlock):
    """The softmax's top ``top_k``, divided by their ``p``-norm (``moe_normalize_expert_weights``) where set."""

    def __init__(self, config: Any, ops: Any) -> None:
        ffn = config.ffn_config
        super().__init__(config, ops, ffn.moe_num_experts, ffn.moe_top_k, ffn.ffn_hidden_size, normalize=False)
        self.p = ffn.moe_normalize_expert_weights

    def routing(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = nn.functional.linear(hidden, self.gate.weight)
        weights, chosen = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        if self.p is not None:
            weights = weights / torch.norm(weights, p=self.p, dim=-1, keepdim=True)
        return weights, chosen


class DbrxDecoderLayer(nn.Module):
    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = DbrxAttention(config, ops, spec, layer_index, rotary)
        self.mlp = DbrxMoeBlock(config, ops)
        self.input_layernorm = LayerNorm(config.hidden_size, NORM_EPS, bias=False)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, NORM_EPS, bias=False)

    def forward(self, positions, hidden, residual, meta):
        hidden, residual = input_norm(self.input_layernorm, hidden, residual)
        hidden, residual = self.post_attention_layernorm(self.self_attn(hidden, positions, meta), residual)
        return self.mlp(hidden), residual


class DbrxModel(LlamaModel):
    layer_class = DbrxDecoderLayer

    def make_norm(self, config: Any, ops: Any) -> nn.Module:
        return LayerNorm(config.hidden_size, NORM_EPS, bias=False)


class DbrxForCausalLM(LlamaForCausalLM):
    model_class = DbrxModel
    #: experts are not split across ranks
    tensor_parallel_plan = None

    def __init__(self, config: Any, ops: Any) -> None:
        activation = config.ffn_config.ffn_act_fn
        if activation != {"name": "silu"}:
            raise NotImplementedError(f"DBRX: ffn_act_fn {activation!r} is not supported (supported: silu)")
        config.num_key_value_heads = config.attn_config.kv_n_heads  # what transformers' attention reads
        theta = getattr(config.attn_config, "rope_theta", None)
        if theta is not None:  # the checkpoints' own field (module docstring)
            config.rope_parameters = {**config.rope_parameters, "rope_theta": float(theta)}
        super().__init__(config, ops)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        return super().load_weights(_our_names(weights, self.config.ffn_config))


def _our_names(weights: Iterable[tuple[str, Any]], ffn: Any) -> Iterator[tuple[str, Any]]:
    for name, tensor in weights:
        prefix, _, stacked = name.rpartition(".ffn.experts.mlp.")
        if not prefix:
            yield parts_renamed(name, RENAMED), tensor
            continue
        if not isinstance(tensor, torch.Tensor):
            raise NotImplementedError(f"{name}: stacked experts from a quantized file")
        experts = tensor.view(ffn.moe_num_experts, ffn.ffn_hidden_size, -1)
        for expert, weight in enumerate(experts.unbind(0)):
            target = f"{parts_renamed(prefix, RENAMED)}.mlp.experts.{expert}.{STACKED[stacked]}.weight"
            yield target, weight.T if stacked == "w2" else weight
