"""GPT-J (``GPTJForCausalLM``: GPT-J-6B): one LayerNorm a layer, whose output both the attention and an
ungated MLP (``fc_in``, GELU, ``fc_out``, with biases) read beside each other (``h + attn + mlp``), q/k/v and
``out_proj`` without biases, rotary on pairs of adjacent values (``models.rotary_pairs``) of the first
``rotary_dim`` of each head at base 10000, and an LM head with a bias. Following transformers'
``modeling_gptj``; the checkpoints' names (``transformer.wte``, ``transformer.h``, ``attn``, ``ln_1``,
``ln_f``) are read as this model's."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import Attention, LayerNorm, Linear, QKVLinear, RotaryEmbedding
from ..quant.attach import QuantizedShards
from .llama import DecoderSpec, LlamaForCausalLM, LlamaModel, head_dim_of, input_norm
from .names import parts_renamed
from .rotary_pairs import pairs_to_rotate_half
from .ungated_mlp import UngatedMLP

RENAMED = (("transformer.wte.", "model.embed_tokens."), ("transformer.ln_f.", "model.norm."),
           ("transformer.h.", "model.layers."), (".attn.", ".self_attn."), (".ln_1.", ".input_layernorm."))
#: buffers of older checkpoints (the causal mask, its fill value) that are not weights
SKIPPED = (".attn.bias", ".attn.masked_bias")


class GPTJAttention(nn.Module):
    def __init__(self, config: Any, ops: Any, layer_index: int, rotary: RotaryEmbedding):
        super().__init__()
        self.head_dim = head_dim_of(config)
        heads, hidden = config.num_attention_heads, config.hidden_size
        self.qkv_proj = QKVLinear(hidden, self.head_dim, heads, heads)
        self.out_proj = Linear(heads * self.head_dim, hidden)
        self.rotary_emb = rotary
        self.attn = Attention(heads, heads, self.head_dim, self.head_dim ** -0.5, ops, None, layer_index)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q, k = self.rotary_emb(positions, q, k)
        return self.out_proj(self.attn(q, k, v, meta))


class GPTJBlock(nn.Module):
    """In the Llama layers' (hidden, residual) protocol: ``attn + mlp`` is handed on beside the layer's input,
    which the next norm adds last, as transformers sums them."""

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = GPTJAttention(config, ops, layer_index, rotary)
        self.mlp = UngatedMLP(config.hidden_size, config.n_inner or 4 * config.hidden_size,
                              config.activation_function, ("fc_in", "fc_out"))
        self.input_layernorm = LayerNorm(config.hidden_size, config.layer_norm_epsilon)

    def forward(self, positions, hidden, residual, meta):
        normed, residual = input_norm(self.input_layernorm, hidden, residual)
        return self.self_attn(normed, positions, meta) + self.mlp(normed), residual


class GPTJModel(LlamaModel):
    layer_class = GPTJBlock

    def make_rotaries(self, config: Any, ops: Any) -> list[RotaryEmbedding]:
        """Base 10000 whatever else the config says, as transformers' ``create_sinusoidal_positions``."""
        rotary = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings,
                                 {"rope_type": "default", "rope_theta": 10000.0}, ops, config.rotary_dim)
        return [rotary] * config.num_hidden_layers

    def make_norm(self, config: Any, ops: Any) -> nn.Module:
        return LayerNorm(config.hidden_size, config.layer_norm_epsilon)


class GPTJForCausalLM(LlamaForCausalLM):
    model_class = GPTJModel
    lm_head_bias = True
    #: its projections are named out_proj / fc_in / fc_out, which the Llama plan does not shard
    tensor_parallel_plan = None

    def __init__(self, config: Any, ops: Any):
        rotary_dim, head_dim = getattr(config, "rotary_dim", None), head_dim_of(config)
        if not rotary_dim or rotary_dim > head_dim or rotary_dim % 2:
            # where rotary_dim is None transformers rotates hidden_size values of each head: one head at most
            raise NotImplementedError(f"GPT-J rotary_dim {rotary_dim!r}: an even number from 2 to the head's "
                                      f"{head_dim} values is supported")
        super().__init__(config, ops)

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        return DecoderSpec(qkv_bias=False, qk_norm=False, sliding_windows=(None,) * config.num_hidden_layers)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        renamed = ((_our_name(name), tensor) for name, tensor in weights if not name.endswith(SKIPPED))
        return super().load_weights(pairs_to_rotate_half(renamed, self.config, self.config.rotary_dim))


def _our_name(name: str) -> str:
    return parts_renamed(name, RENAMED)
