"""LFM2 (Liquid AI's LFM2-350M / 700M / 1.2B / 2.6B and LFM2.5, edge models run on CPUs): a hybrid of gated
short-convolution layers and attention layers, as ``layer_types`` names them ("conv", "full_attention"; older
configs name the attention layers by ``full_attn_idxs``), following transformers' ``modeling_lfm2``.

- A short-convolution layer (`Lfm2ShortConv`, a `RecurrentLayer`) projects its input to B, C and x
  (``in_proj``, in that order), runs ``B * x`` through a depthwise causal convolution of ``conv_L_cache`` taps
  (``layers.recurrent.causal_conv1d``, each sequence continuing from its last ``conv_L_cache - 1`` inputs, the
  layer's state), multiplies that by C and projects it back (``out_proj``); ``conv_bias`` puts biases on all
  three.
- An attention layer is Llama's GQA attention with q and k RMS-normalized per head before rotary
  (``q_layernorm`` / ``k_layernorm``, read as ``LlamaAttention``'s ``q_norm`` / ``k_norm``) and an
  ``out_proj``.
- Every layer is pre-norm (``operator_norm`` before the mixer, ``ffn_norm`` before the MLP) with a SwiGLU MLP
  (``w1`` gate, ``w3`` up, ``w2`` down) whose width is ``intermediate_size`` reshaped when
  ``block_auto_adjust_ff_dim``: two thirds of it, times ``block_ffn_dim_multiplier``, rounded up to a
  multiple of ``block_multiple_of`` (LFM2-1.2B: 12,288 -> 8,192).
- The final norm is ``model.embedding_norm``; all norms' epsilon is ``norm_eps``.

LFM2-MoE (models/lfm2_moe.py) and LFM3 (models/lfm3.py) reuse these layers: ``use_sandwich_norm`` (LFM3's)
also normalizes each mixer's and MLP's output before the residual adds it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import Linear, RMSNorm, RotaryEmbedding
from ..layers.recurrent import DepthwiseConv, RecurrentLayer, StateSpec, segments
from ..quant.attach import QuantizedShards
from .llama import DecoderSpec, LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel, input_norm
from .names import parts_renamed

LAYER_TYPES = ("conv", "full_attention")
# (theirs, ours): the checkpoints' names read as the Llama modules'; the MLP's (and experts') w1 / w3 / w2
# then load into gate_up_proj and down_proj as Llama's gate / up / down do
RENAMED = ((".self_attn.out_proj.", ".self_attn.o_proj."),
           (".self_attn.q_layernorm.", ".self_attn.q_norm."),
           (".self_attn.k_layernorm.", ".self_attn.k_norm."),
           (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."),
           ("model.embedding_norm.", "model.norm."))


def check_layer_types(config: Any, family: str, layer_types: tuple[str, ...] = LAYER_TYPES) -> None:
    """NotImplementedError where ``layer_types`` is missing or names a layer this implementation does not serve."""
    if getattr(config, "layer_types", None) is None:
        raise NotImplementedError(f"{family}: the config names no layer_types (which layers convolve and which "
                                  "attend)")
    unknown = sorted(set(config.layer_types) - set(layer_types))
    if unknown:
        raise NotImplementedError(f"{family}: layer_types {unknown} are not supported (supported: {layer_types})")


def mlp_size(config: Any) -> int:
    """The MLP's width: ``intermediate_size``, reshaped as LFM2's ``block_auto_adjust_ff_dim`` says (LFM2-MoE's
    and LFM3's configs have no such field: their widths are as given)."""
    size = config.intermediate_size
    if not getattr(config, "block_auto_adjust_ff_dim", False):
        return size
    size = int(config.block_ffn_dim_multiplier * int(2 * size / 3))
    multiple = config.block_multiple_of
    return multiple * ((size + multiple - 1) // multiple)


class Lfm2ShortConv(RecurrentLayer):
    """``out_proj(C * conv(B * x))`` with ``B, C, x = in_proj(hidden)``; its state: each sequence's last
    ``conv_L_cache - 1`` values of ``B * x`` [hidden_size, conv_L_cache - 1]."""

    def __init__(self, config: Any):
        super().__init__()
        size, bias = config.hidden_size, bool(config.conv_bias)
        self.in_proj = Linear(size, 3 * size, bias=bias)
        self.conv = DepthwiseConv(size, config.conv_L_cache, bias)
        self.out_proj = Linear(size, size, bias=bias)

    def state_specs(self) -> tuple[StateSpec, ...]:
        channels, _, taps = self.conv.weight.shape
        return (StateSpec((channels, taps - 1)),)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        b, c, x = self.in_proj(hidden).chunk(3, dim=-1)
        (conv_state,) = self.bound_states()
        mixed = self.conv(b * x, conv_state, segments(meta))
        return self.out_proj(c * mixed)


class Lfm2DecoderLayer(nn.Module):
    """A short convolution (``conv``) or attention (``self_attn``) as ``layer_types`` says, then the MLP
    (``feed_forward``), each behind its pre-norm; with ``use_sandwich_norm`` (LFM3) their outputs normalized
    too (``post_operator_norm``, ``post_ffn_norm``). Keeps the Llama layers' (hidden, residual) protocol."""

    #: The attention's class (LFM3 gates each head's output).
    attention_class: type[nn.Module] = LlamaAttention

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding | None):
        super().__init__()
        size, eps = config.hidden_size, config.norm_eps
        is_conv = config.layer_types[layer_index] == "conv"
        self.conv = Lfm2ShortConv(config) if is_conv else None
        self.self_attn = None if is_conv else self.attention_class(config, ops, spec, layer_index, rotary)
        self.feed_forward = self.make_mlp(config, ops, layer_index)
        self.operator_norm = RMSNorm(size, eps, ops)
        self.ffn_norm = RMSNorm(size, eps, ops)
        sandwich = bool(getattr(config, "use_sandwich_norm", False))
        self.post_operator_norm = RMSNorm(size, eps, ops) if sandwich else None
        self.post_ffn_norm = RMSNorm(size, eps, ops) if sandwich else None

    def make_mlp(self, config: Any, ops: Any, layer_index: int) -> nn.Module:
        """The layer's MLP (LFM2-MoE's sparse layers build their experts here)."""
        return LlamaMLP(config, ops, mlp_size(config))

    def mix(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.conv is not None:
            return self.conv(hidden, meta)
        return self.self_attn(hidden, positions, meta)

    def forward(self, positions, hidden, residual, meta):
        hidden, residual = input_norm(self.operator_norm, hidden, residual)
        hidden = _normed(self.post_operator_norm, self.mix(hidden, positions, meta))
        hidden, residual = self.ffn_norm(hidden, residual)
        return _normed(self.post_ffn_norm, self.feed_forward(hidden)), residual


def _normed(norm: nn.Module | None, hidden: torch.Tensor) -> torch.Tensor:
    return hidden if norm is None else norm(hidden)


class Lfm2Model(LlamaModel):
    layer_class = Lfm2DecoderLayer


class Lfm2ForCausalLM(LlamaForCausalLM):
    model_class = Lfm2Model
    #: the short convolutions' projections are not sharded
    tensor_parallel_plan = None
    #: the family's name in the errors refusing a config
    family = "LFM2"

    def __init__(self, config: Any, ops: Any):
        self.check_supported(config)
        config.rms_norm_eps = config.norm_eps  # what LlamaAttention's q/k norms and the final norm read
        super().__init__(config, ops)

    @classmethod
    def check_supported(cls, config: Any) -> None:
        check_layer_types(config, cls.family)

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        return DecoderSpec(qkv_bias=False, qk_norm=True, sliding_windows=(None,) * config.num_hidden_layers)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        return super().load_weights(_our_names(weights))


def _our_names(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    for name, tensor in weights:
        yield parts_renamed(name, RENAMED), tensor
