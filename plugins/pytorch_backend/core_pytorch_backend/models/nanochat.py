"""NanoChat (Karpathy's nanochat): Llama's pre-norm layers with every norm an RMSNorm without a weight (one more
over the embeddings before the first layer), q and k normalized so head by head after rotary, a relu² MLP of
``fc1`` / ``fc2`` without biases, and soft-capped logits (``final_logit_softcapping``, Gemma 2's). Its rotary
turns the other way (transformers' ``rotate_half`` is ``cat(x2, -x1)`` there): each head's q and k rows are read
with their halves swapped (``rotary_pairs.halves_swapped_order``), and the rotary is Llama's from then on."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import RotaryEmbedding
from ..layers.norm import WeightlessRMSNorm
from ..quant.attach import QuantizedShards
from .gemma3 import Gemma3ForCausalLM
from .llama import DecoderSpec, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, head_dim_of
from .rotary_pairs import halves_swapped_order, q_k_rows_reordered
from .ungated_mlp import UngatedMLP


class NanoChatAttention(LlamaAttention):
    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding):
        super().__init__(config, ops, spec, layer_index, rotary)
        self.q_norm = self.k_norm = WeightlessRMSNorm(config.rms_norm_eps, ops)  # head by head, after rotary

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q, k = self.rotary_emb(positions, q, k)
        t = q.shape[0]
        q = self.q_norm(q.reshape(t, -1, self.head_dim)).reshape(t, -1)
        k = self.k_norm(k.reshape(t, -1, self.head_dim)).reshape(t, -1)
        return self.o_proj(self.attn(q, k, v, meta))


class NanoChatDecoderLayer(LlamaDecoderLayer):
    attention_class = NanoChatAttention

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding):
        super().__init__(config, ops, spec, layer_index, rotary)
        # the op set's rms_norm and relu^2: the native decode stack calls their kernels
        self.input_layernorm = WeightlessRMSNorm(config.rms_norm_eps, ops)
        self.post_attention_layernorm = WeightlessRMSNorm(config.rms_norm_eps, ops)

    def make_mlp(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int) -> nn.Module:
        return UngatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, ("fc1", "fc2"),
                          bias=False, ops=ops)


class NanoChatModel(LlamaModel):
    layer_class = NanoChatDecoderLayer

    def make_norm(self, config: Any, ops: Any) -> nn.Module:
        return WeightlessRMSNorm(config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings, normalized (transformers applies the final norm's module to them too)."""
        return self.norm(self.embed_tokens(input_ids))


class NanoChatForCausalLM(LlamaForCausalLM):
    model_class = NanoChatModel
    tensor_parallel_plan = None  # q / k rows reordered at load; its MLP's names are not the Llama plan's
    compute_logits = Gemma3ForCausalLM.compute_logits  # soft-capped by final_logit_softcapping

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderSpec(qkv_bias=bias, qk_norm=False, sliding_windows=(None,) * config.num_hidden_layers,
                           o_bias=bias)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        halves_swapped = halves_swapped_order(head_dim_of(self.config))
        return super().load_weights(q_k_rows_reordered(weights, self.config, halves_swapped))
