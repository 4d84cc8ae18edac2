"""GPT-2 (``GPT2LMHeadModel``: gpt2, distilgpt2, and the many models of its layout): learned absolute positions
(``wpe``), pre-norm layers with LayerNorms, q/k/v fused in ``c_attn``, an ungated GELU MLP (``c_fc`` /
``c_proj``), biases everywhere, the attention scaled by ``head_dim ** -0.5`` (and by the layer's inverse
index where ``scale_attn_by_inverse_layer_idx``), the LM head tied to ``wte``. Its checkpoints keep the
projections as ``Conv1D`` weights ([in, out]): they are transposed at load (a GGUF file's quantized blocks of
them cannot be, and are refused). Following transformers' ``modeling_gpt2``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import Attention, LayerNorm, Linear, VocabEmbedding
from ..quant.attach import QuantizedShards
from .llama import DecoderSpec, LlamaForCausalLM, LlamaModel, input_norm
from .names import prefix_renamed
from .ungated_mlp import UngatedMLP

CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight", ".mlp.c_proj.weight")
RENAMED = (("transformer.wte.", "model.embed_tokens."), ("transformer.wpe.", "model.embed_positions."),
           ("transformer.ln_f.", "model.norm."), ("transformer.h.", "model.layers."))
#: buffers of older checkpoints (the causal mask, its fill value) that are not weights
SKIPPED = (".attn.bias", ".attn.masked_bias")


class GPT2Attention(nn.Module):
    def __init__(self, config: Any, ops: Any, layer_index: int):
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        head_dim = hidden // heads
        scaling = head_dim ** -0.5 if getattr(config, "scale_attn_weights", True) else 1.0
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            scaling /= float(layer_index + 1)
        self.c_attn = Linear(hidden, 3 * hidden, bias=True)
        self.c_proj = Linear(hidden, hidden, bias=True)
        self.attn = Attention(heads, heads, head_dim, scaling, ops, None, layer_index)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.c_attn(hidden).chunk(3, dim=-1)
        return self.c_proj(self.attn(q.contiguous(), k.contiguous(), v.contiguous(), meta))


class GPT2Block(nn.Module):
    def __init__(self, config: Any, ops: Any, layer_index: int):
        super().__init__()
        eps, hidden = config.layer_norm_epsilon, config.hidden_size
        self.ln_1 = LayerNorm(hidden, eps)
        self.attn = GPT2Attention(config, ops, layer_index)
        self.ln_2 = LayerNorm(hidden, eps)
        inner = getattr(config, "n_inner", None) or 4 * hidden
        self.mlp = UngatedMLP(hidden, inner, config.activation_function, ("c_fc", "c_proj"))

    def forward(self, positions, hidden, residual, meta):
        """In the Llama layers' (hidden, residual) protocol: the next norm adds the two."""
        normed, residual = input_norm(self.ln_1, hidden, residual)
        normed, residual = self.ln_2(self.attn(normed, positions, meta), residual)
        return self.mlp(normed), residual


class GPT2Model(LlamaModel):
    def __init__(self, config: Any, ops: Any, spec: DecoderSpec):
        nn.Module.__init__(self)  # not LlamaModel's: no rotary, positions of its own
        if getattr(config, "add_cross_attention", False):
            raise NotImplementedError("GPT-2: add_cross_attention (an encoder-decoder) is not supported")
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.embed_positions = VocabEmbedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(GPT2Block(config, ops, i) for i in range(config.num_hidden_layers))
        self.norm = LayerNorm(config.hidden_size, config.layer_norm_epsilon)

    def forward(self, input_ids, positions, meta, embed_overrides=None):
        hidden = self.embed_inputs(input_ids, embed_overrides) + self.embed_positions(positions)
        return self.run_layers(hidden, positions, meta)


class GPT2LMHeadModel(LlamaForCausalLM):
    model_class = GPT2Model
    tensor_parallel_plan = None  # q/k/v fused in c_attn: the Llama plan's shards do not apply

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        return DecoderSpec(qkv_bias=True, qk_norm=False, sliding_windows=(None,) * config.num_hidden_layers,
                           o_bias=True)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        return super().load_weights(_ours(name, tensor) for name, tensor in weights if not name.endswith(SKIPPED))


def _ours(name: str, tensor: Any) -> tuple[str, Any]:
    """The HF name as this model's, a Conv1D weight as a Linear's."""
    if name.endswith(CONV1D):
        if not isinstance(tensor, torch.Tensor):
            raise NotImplementedError(f"GPT-2: {name} is stored quantized, which cannot be transposed here")
        tensor = tensor.t().contiguous()
    return prefix_renamed(name, RENAMED), tensor
