"""StableLM (``StableLmForCausalLM``: StableLM 2, StableLM-3B-4E1T): Llama's attention and gated MLP with
LayerNorm (weight and bias) in place of RMSNorm, q/k/v biases (``use_qkv_bias``), rotary on the first
``partial_rotary_factor`` of each head (a quarter in the released checkpoints), and optionally a LayerNorm of
its own for each head of q and k (``qk_layernorm``: StableLM 2 12B) and a parallel residual
(``use_parallel_residual``: attention and MLP both read the input norm, ``h + attn + mlp``). Following
transformers' ``modeling_stablelm``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import LayerNorm, RotaryEmbedding
from .llama import DecoderSpec, LayerNormModel, LlamaAttention, LlamaForCausalLM, LlamaMLP, input_norm


class LayerNormPerHead(nn.Module):
    """One bias-free LayerNorm per head of a [T, H, D] tensor (``norms.{h}``, as transformers names them)."""

    def __init__(self, head_dim: int, heads: int, eps: float):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(head_dim, eps=eps, bias=False) for _ in range(heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([norm(x[:, h : h + 1]) for h, norm in enumerate(self.norms)], dim=1)


class StableLmAttention(LlamaAttention):
    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding):
        super().__init__(config, ops, spec, layer_index, rotary)
        eps = config.layer_norm_eps
        self.q_layernorm = self.k_layernorm = None
        if getattr(config, "qk_layernorm", False):
            self.q_layernorm = LayerNormPerHead(self.head_dim, config.num_attention_heads, eps)
            self.k_layernorm = LayerNormPerHead(self.head_dim, config.num_key_value_heads, eps)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.q_layernorm is None:
            return super().forward(hidden, positions, meta)
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        t = q.shape[0]
        q = self.q_layernorm(q.reshape(t, -1, self.head_dim))
        k = self.k_layernorm(k.reshape(t, -1, self.head_dim))
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q.reshape(t, -1), k.reshape(t, -1), v, meta))


class StableLmDecoderLayer(nn.Module):
    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = StableLmAttention(config, ops, spec, layer_index, rotary)
        self.mlp = LlamaMLP(config, ops)
        self.input_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps, ops=ops)
        parallel = bool(getattr(config, "use_parallel_residual", False))
        self.post_attention_layernorm = None if parallel else LayerNorm(config.hidden_size, config.layer_norm_eps,
                                                                        ops=ops)

    def forward(self, positions, hidden, residual, meta):
        """In the Llama layers' (hidden, residual) protocol: the next layer (or the final norm) adds the two."""
        normed, residual = input_norm(self.input_layernorm, hidden, residual)
        attn = self.self_attn(normed, positions, meta)
        if self.post_attention_layernorm is None:  # parallel: (h + attn) + mlp, the MLP on the same norm
            return self.mlp(normed), residual + attn
        normed, residual = self.post_attention_layernorm(attn, residual)
        return self.mlp(normed), residual


class StableLmModel(LayerNormModel):
    layer_class = StableLmDecoderLayer
    partial_rotary = True


class StableLmForCausalLM(LlamaForCausalLM):
    model_class = StableLmModel
    #: per-head q/k norms (the 12B) belong to the heads a rank holds; not sharded
    tensor_parallel_plan = None

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        return DecoderSpec(qkv_bias=bool(getattr(config, "use_qkv_bias", False)), qk_norm=False,
                           sliding_windows=(None,) * config.num_hidden_layers, o_bias=False)
