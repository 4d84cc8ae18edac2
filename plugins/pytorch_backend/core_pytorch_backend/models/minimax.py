"""MiniMax-Text-01 and MiniMax-M1 (``MiniMaxForCausalLM``: the transformers-format checkpoints
MiniMaxAI/MiniMax-Text-01-hf, MiniMax-M1-40k-hf and MiniMax-M1-80k-hf): 80 layers, seven of every eight
lightning attention (models/lightning_attention.py: linear attention with a decaying state per sequence, no
KV cache) and the eighth softmax attention (Llama's, GQA, rotary), as ``layer_types`` names them
(``linear_attention`` / ``full_attention``); every MLP a sparse mixture of ``num_local_experts`` SwiGLU
experts of ``intermediate_size``, each token through its ``num_experts_per_tok`` best, renormalized
(models/sparse_moe.py).

Its layers are post-norm with scaled residuals, as transformers' ``MiniMaxDecoderLayer``: the residual is the
normalized input, ``h = alpha * norm(x) + beta * mixer(norm(x))``, then ``out = alpha' * norm'(h) + beta' *
moe(norm'(h))``, the factors per layer kind (``linear_attn_*`` / ``full_attn_*`` / ``mlp_alpha_factor`` /
``mlp_beta_factor``; the released checkpoints' alphas are 3.5566, their betas 1). Each layer hands the two
terms of its sum on as (hidden, residual), which the next norm adds, as the Llama decoders do.

Rotary turns the first ``rotary_dim`` values of each head (the released configs' legacy field: 64 of 128),
or ``head_dim * partial_rotary_factor``, as MiniMax trained them; transformers 5 reads neither and turns the
whole head (the bug its MiniMax-M2 fix, huggingface/transformers#48241, mended for that model only).
The original configs' fields are checked against what transformers serves: ``attn_type_list`` must agree
with ``layer_types``, ``postnorm`` be true and ``shared_intermediate_size`` 0 (as the released ones are), and
``sliding_window`` unset. Checkpoint names as Mixtral's (``block_sparse_moe``, experts' ``w1`` / ``w3`` /
``w2``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import RMSNorm, RotaryEmbedding
from ..layers.rotary import context_positions, rope_parameters, rotary_dim_of
from ..quant.attach import QuantizedShards
from .lightning_attention import DERIVED_BUFFERS, LightningAttention
from .llama import DecoderSpec, LlamaAttention, LlamaForCausalLM, LlamaModel, head_dim_of, input_norm
from .mixtral import RENAMED
from .names import parts_renamed
from .sparse_moe import SparseMoeBlock

LAYER_TYPES = ("full_attention", "linear_attention")
LEGACY_TYPES = {0: "linear_attention", 1: "full_attention"}  # the original configs' attn_type_list values


def is_lightning(config: Any, layer_index: int) -> bool:
    return config.layer_types[layer_index] == "linear_attention"


class MiniMaxDecoderLayer(nn.Module):
    """A lightning or softmax attention layer (module docstring), with its residual factors."""

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int,
                 rotary: RotaryEmbedding):
        super().__init__()
        if is_lightning(config, layer_index):
            self.self_attn: nn.Module = LightningAttention(config, ops, layer_index)
            self.attn_alpha = config.linear_attn_alpha_factor
            self.attn_beta = config.linear_attn_beta_factor
        else:
            self.self_attn = LlamaAttention(config, ops, spec, layer_index, rotary)
            self.attn_alpha = config.full_attn_alpha_factor
            self.attn_beta = config.full_attn_beta_factor
        self.mlp_alpha, self.mlp_beta = config.mlp_alpha_factor, config.mlp_beta_factor
        self.mlp = SparseMoeBlock(config, ops, config.num_local_experts, config.num_experts_per_tok,
                                  config.intermediate_size, normalize=True)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        normed, _ = input_norm(self.input_layernorm, hidden, residual)
        mixed = self.self_attn(normed, positions, meta)
        normed, _ = self.post_attention_layernorm(mixed * self.attn_beta, normed * self.attn_alpha)
        return self.mlp(normed) * self.mlp_beta, normed * self.mlp_alpha


class MiniMaxModel(LlamaModel):
    layer_class = MiniMaxDecoderLayer

    def make_rotaries(self, config: Any, ops: Any) -> list[RotaryEmbedding]:
        head_dim = head_dim_of(config)
        rotary = RotaryEmbedding(head_dim, context_positions(config), rope_parameters(config), ops,
                                 rotary_width(config, head_dim))
        return [rotary] * config.num_hidden_layers


def rotary_width(config: Any, head_dim: int) -> int:
    """The values of each head rotary turns: the legacy ``rotary_dim`` where set, else the partial
    factor's."""
    width = getattr(config, "rotary_dim", None)
    if width is None:
        return rotary_dim_of(config, head_dim)
    if not 0 < width <= head_dim or width % 2:
        raise NotImplementedError(f"MiniMax: rotary_dim {width} is not supported (an even number from 2 "
                                  f"to head_dim {head_dim})")
    return width


class MiniMaxForCausalLM(LlamaForCausalLM):
    model_class = MiniMaxModel
    #: experts are not split across ranks, nor lightning attention's heads
    tensor_parallel_plan = None

    def __init__(self, config: Any, ops: Any):
        check_config(config)
        super().__init__(config, ops)

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        windows = (None,) * config.num_hidden_layers
        return DecoderSpec(qkv_bias=False, qk_norm=False, sliding_windows=windows)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        kept = ((name, tensor) for name, tensor in weights if not name.endswith(DERIVED_BUFFERS))
        return super().load_weights((parts_renamed(name, RENAMED), tensor) for name, tensor in kept)


def check_config(config: Any) -> None:
    """Raises on the fields of MiniMax's original configs that transformers' MiniMax does not serve."""
    types = list(config.layer_types)
    if len(types) != config.num_hidden_layers or set(types) - set(LAYER_TYPES):
        raise ValueError(f"MiniMax: layer_types must name {config.num_hidden_layers} layers, each one of "
                         f"{', '.join(LAYER_TYPES)}; got {types}")
    legacy = getattr(config, "attn_type_list", None)
    if legacy is not None and [LEGACY_TYPES.get(kind) for kind in legacy] != types:
        raise ValueError(f"MiniMax: attn_type_list {legacy} (0: lightning, 1: softmax) disagrees with "
                         f"layer_types {types}")
    if getattr(config, "sliding_window", None) is not None:
        raise NotImplementedError(f"MiniMax: sliding_window {config.sliding_window} is not supported "
                                  "(transformers windows a prompt's softmax attention and not its decode "
                                  "steps'; the released checkpoints set none)")
    if not getattr(config, "postnorm", True):
        raise NotImplementedError("MiniMax: postnorm false is not supported (transformers' layers are "
                                  "post-norm)")
    if getattr(config, "shared_intermediate_size", 0):
        raise NotImplementedError(f"MiniMax: shared_intermediate_size {config.shared_intermediate_size} is "
                                  "not supported (transformers' MiniMax has no shared expert)")
