"""Mamba-2 (``Mamba2ForCausalLM``: Mistral's Mamba-Codestral-7B-v0.1, state-spaces/mamba2-* converted to
transformers' layout): no attention at all, so the model owns no KV cache, only each layer's recurrent states.
Every layer is an RMSNorm then the Mamba-2 mixer (models/mamba2_mixer.py), added to the residual; a final
RMSNorm (``norm_f``) and the LM head, tied to the embeddings where ``tie_word_embeddings`` says. Checkpoints
name the stack ``backbone`` (``embeddings``, or ``embedding`` in older conversions, ``layers.{i}.norm`` /
``.mixer``, ``norm_f``), read here as the Llama loader's names. The residual stream stays in the model's dtype
(``residual_in_fp32`` keeps it in float32 in transformers: the same values in float32, a rounding apart in
bfloat16)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import LMHead, RMSNorm
from ..quant.attach import QuantizedShards
from .llama import LlamaForCausalLM, LlamaModel, input_norm
from .mamba2_mixer import Mamba2Mixer, MixerSpec, time_step_limit_of
from .names import prefix_renamed

RENAMED = (("backbone.embeddings.", "model.embed_tokens."), ("backbone.embedding.", "model.embed_tokens."),
           ("backbone.norm_f.", "model.norm."), ("backbone.", "model."))


def mixer_spec(config: Any) -> MixerSpec:
    inner = int(config.expand * config.hidden_size)
    if inner != config.num_heads * config.head_dim:
        raise NotImplementedError(f"Mamba-2: expand * hidden_size ({inner}) is not num_heads * head_dim "
                                  f"({config.num_heads} x {config.head_dim})")
    return MixerSpec(hidden_size=config.hidden_size, heads=config.num_heads, head_dim=config.head_dim,
                     state_size=config.state_size, groups=config.n_groups, conv_kernel=config.conv_kernel,
                     chunk_size=config.chunk_size, norm_eps=config.layer_norm_epsilon, activation=config.hidden_act,
                     conv_bias=bool(config.use_conv_bias), in_bias=bool(config.use_bias),
                     out_bias=bool(config.use_bias), time_step_limit=time_step_limit_of(config.time_step_limit))


class Mamba2Block(nn.Module):
    """RMSNorm, then the mixer; the (hidden, residual) protocol of the Llama layers."""

    def __init__(self, config: Any, ops: Any, spec: None, layer_index: int, rotary: None):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon, ops)
        self.mixer = Mamba2Mixer(mixer_spec(config))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = input_norm(self.norm, hidden, residual)
        return self.mixer(hidden, meta), residual


class Mamba2Model(LlamaModel):
    layer_class = Mamba2Block

    def make_rotaries(self, config: Any, ops: Any) -> list[None]:
        return [None] * config.num_hidden_layers

    def make_norm(self, config: Any, ops: Any) -> nn.Module:
        return RMSNorm(config.hidden_size, config.layer_norm_epsilon, ops)


class Mamba2ForCausalLM(LlamaForCausalLM):
    model_class = Mamba2Model
    tensor_parallel_plan = None

    def __init__(self, config: Any, ops: Any):
        nn.Module.__init__(self)  # Llama's reads attention heads, which Mamba-2 has none of
        self.config, self.ops = config, ops
        self.model = self.model_class(config, ops, None)
        tie = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, self.model.embed_tokens if tie else None)
        self.num_layers = config.num_hidden_layers

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        return super().load_weights((prefix_renamed(name, RENAMED), tensor) for name, tensor in weights)
