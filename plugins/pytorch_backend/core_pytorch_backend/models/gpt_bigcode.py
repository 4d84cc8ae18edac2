"""GPTBigCode (``GPTBigCodeForCausalLM``: StarCoder 1, SantaCoder, tiny_starcoder): GPT-2's layout (learned
absolute positions, pre-norm LayerNorms, biases everywhere, an ungated GELU-tanh MLP ``c_fc`` / ``c_proj``, the
LM head tied to ``wte``) with ``nn.Linear`` weights rather than GPT-2's Conv1D, and q/k/v fused in ``c_attn``
as either multi-query (``multi_query``: every q head, then one k and one v head) or every head's q, k and v
side by side. ``attention_softmax_in_fp32`` / ``scale_attention_softmax_in_fp32`` change nothing in float32
(transformers' softmax runs in float32 either way; so does ours). Following transformers'
``modeling_gpt_bigcode``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import Attention, LayerNorm, Linear, VocabEmbedding
from ..quant.attach import QuantizedShards
from .gpt2 import RENAMED, GPT2Block, GPT2LMHeadModel, GPT2Model
from .names import prefix_renamed
from .ungated_mlp import UngatedMLP

#: the causal mask, a buffer older checkpoints may keep beside the weights
SKIPPED = "transformer.bias"


class GPTBigCodeAttention(nn.Module):
    def __init__(self, config: Any, ops: Any, layer_index: int):
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.head_dim = hidden // heads
        self.multi_query = bool(config.multi_query)
        kv_heads = 1 if self.multi_query else heads
        scaling = self.head_dim ** -0.5 if config.scale_attn_weights else 1.0
        self.c_attn = Linear(hidden, hidden + 2 * kv_heads * self.head_dim, bias=True)
        self.c_proj = Linear(hidden, hidden, bias=True)
        self.attn = Attention(heads, kv_heads, self.head_dim, scaling, ops, None, layer_index)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t, qkv = hidden.shape[0], self.c_attn(hidden)
        if self.multi_query:  # [q of every head | k | v]
            q, k, v = qkv.split((qkv.shape[-1] - 2 * self.head_dim, self.head_dim, self.head_dim), dim=-1)
        else:  # [q, k, v of head 0 | of head 1 | ...]
            q, k, v = qkv.view(t, -1, 3 * self.head_dim).chunk(3, dim=-1)
        out = self.attn(q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1), meta)
        return self.c_proj(out)


class GPTBigCodeBlock(GPT2Block):
    """GPT-2's block (and its forward) around this attention."""

    def __init__(self, config: Any, ops: Any, layer_index: int):
        nn.Module.__init__(self)
        eps, hidden = config.layer_norm_epsilon, config.hidden_size
        self.ln_1 = LayerNorm(hidden, eps)
        self.attn = GPTBigCodeAttention(config, ops, layer_index)
        self.ln_2 = LayerNorm(hidden, eps)
        self.mlp = UngatedMLP(hidden, config.n_inner or 4 * hidden, config.activation_function, ("c_fc", "c_proj"))


class GPTBigCodeModel(GPT2Model):
    """GPT-2's model (its forward: token + position embeddings) over GPTBigCode blocks."""

    def __init__(self, config: Any, ops: Any, spec: Any):
        nn.Module.__init__(self)
        if getattr(config, "add_cross_attention", False):
            raise NotImplementedError("GPTBigCode: add_cross_attention (an encoder-decoder) is not supported")
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.embed_positions = VocabEmbedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(GPTBigCodeBlock(config, ops, i) for i in range(config.num_hidden_layers))
        self.norm = LayerNorm(config.hidden_size, config.layer_norm_epsilon)


class GPTBigCodeForCausalLM(GPT2LMHeadModel):
    model_class = GPTBigCodeModel
    tensor_parallel_plan = None  # q/k/v fused in c_attn: the Llama plan's shards do not apply

    def __init__(self, config: Any, ops: Any):
        config.num_key_value_heads = 1 if config.multi_query else config.num_attention_heads  # what the cache holds
        super().__init__(config, ops)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        """The names as this model's; no Conv1D transposes (GPT-2's load_weights is skipped)."""
        return super(GPT2LMHeadModel, self).load_weights(
            (_our_name(name), tensor) for name, tensor in weights if name != SKIPPED)


def _our_name(name: str) -> str:
    return prefix_renamed(name, RENAMED)
