"""Command R (``CohereForCausalLM``): one bias-free LayerNorm a layer, computed in float32, whose output both
the attention and the gated MLP read beside each other (``h + attn + mlp``), rotary on pairs of adjacent
values (``models.rotary_pairs``), optionally q and k LayerNorm-ed head by head with a weight per head
(``use_qk_norm``: Command R+), biases on q/k/v/o where ``attention_bias``, and the logits times
``logit_scale``. Following transformers' ``modeling_cohere``."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ..layers import LayerNorm, RotaryEmbedding
from ..native.half_weights import HalfWeight
from ..quant.affine import AffineWeight
from .llama import (
    DecoderSpec,
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    head_dim_of,
    input_norm,
)
from .rotary_pairs import Weight, pairs_to_rotate_half, rotate_half_order


class CohereLayerNorm(LayerNorm):
    """transformers' ``CohereLayerNorm``: a weight-only LayerNorm over the last dimension, in float32; for q
    and k its weight is [heads, head_dim], one per head. With ``ops`` (the layers' input norms), the op set's
    ``layer_norm`` where it has one: the same float32 computation, in the kernel the native decode stack calls."""

    def __init__(self, shape: int | tuple[int, int], eps: float, ops: Any = None):
        super().__init__(shape, eps, bias=False, ops=ops)

    def normalized(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        mean = h.mean(-1, keepdim=True)
        variance = (h - mean).pow(2).mean(-1, keepdim=True)
        return (self.weight.float() * ((h - mean) * torch.rsqrt(variance + self.eps))).to(x.dtype)


class CohereAttention(LlamaAttention):
    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding):
        super().__init__(config, ops, spec, layer_index, rotary)
        if getattr(config, "use_qk_norm", False):  # LlamaAttention.forward applies them head by head
            self.q_norm = CohereLayerNorm((config.num_attention_heads, self.head_dim), config.layer_norm_eps)
            self.k_norm = CohereLayerNorm((config.num_key_value_heads, self.head_dim), config.layer_norm_eps)


class CohereDecoderLayer(torch.nn.Module):
    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = CohereAttention(config, ops, spec, layer_index, rotary)
        self.mlp = self.make_mlp(config, ops, layer_index)
        self.input_layernorm = self.make_norm(config, ops)

    def make_mlp(self, config: Any, ops: Any, layer_index: int) -> torch.nn.Module:
        """The layer's MLP (Cohere 2 MoE's sparse layers build their experts here)."""
        return LlamaMLP(config, ops)

    def make_norm(self, config: Any, ops: Any) -> torch.nn.Module:
        """The input norm (Cohere 2 MoE's may be an RMSNorm)."""
        return CohereLayerNorm(config.hidden_size, config.layer_norm_eps, ops)

    def forward(self, positions, hidden, residual, meta):
        """In the Llama layers' (hidden, residual) protocol: (h + attn) + mlp, the next norm adding mlp."""
        normed, residual = input_norm(self.input_layernorm, hidden, residual)
        return self.mlp(normed), residual + self.self_attn(normed, positions, meta)


class CohereModel(LlamaModel):
    layer_class = CohereDecoderLayer

    def make_norm(self, config: Any, ops: Any) -> torch.nn.Module:
        return CohereLayerNorm(config.hidden_size, config.layer_norm_eps)


class CohereForCausalLM(LlamaForCausalLM):
    model_class = CohereModel
    #: the q/k norms' per-head weights belong to the heads a rank holds; not sharded
    tensor_parallel_plan = None

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderSpec(qkv_bias=bias, qk_norm=False, sliding_windows=(None,) * config.num_hidden_layers,
                           o_bias=bias)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) * self.config.logit_scale

    def load_weights(self, weights):
        return super().load_weights(_qk_norms_reordered(pairs_to_rotate_half(weights, self.config),
                                                        head_dim_of(self.config)))


def _qk_norms_reordered(weights: Iterable[tuple[str, Weight]], head_dim: int) -> Iterator[tuple[str, Weight]]:
    """The per-head q/k norm weights' values in the rotate-half order the q and k projections' rows take."""
    order = torch.from_numpy(rotate_half_order(head_dim, head_dim))
    for name, tensor in weights:
        if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
            if isinstance(tensor, AffineWeight):
                raise NotImplementedError(f"{name}: a quantized q/k norm weight is not supported")
            tensor = (tensor.values if isinstance(tensor, HalfWeight) else tensor)[..., order]  # loaded dense
        yield name, tensor
