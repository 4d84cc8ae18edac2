"""Mamba (``MambaForCausalLM``: state-spaces/mamba-130m-hf to mamba-2.8b-hf) and FalconMamba
(``FalconMambaForCausalLM``: tiiuae/falcon-mamba-7b and its instruct model). No attention at all: the model
owns no KV cache, only its layers' recurrent states. Each layer adds a Mamba-1 mixer (models/mamba_mixer.py;
FalconMamba's RMS-normalizes its time step, B and C) of its RMSNorm'd input (``layer_norm_epsilon``) to the
residual stream, which ``residual_in_fp32`` (every published checkpoint sets it) keeps in float32 whatever
the model's dtype, as transformers does; then a final RMSNorm and the LM head, tied to the embeddings where
``tie_word_embeddings``. Checkpoint names ``backbone.embeddings`` (``backbone.embedding`` too, as
transformers' load hook reads it), ``backbone.layers.{i}.norm`` and ``.mixer.*``, ``backbone.norm_f``,
``lm_head``.
Following transformers' ``modeling_mamba`` and ``modeling_falcon_mamba``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import LMHead, RMSNorm, VocabEmbedding
from ..quant.attach import QuantizedShards
from .llama import LlamaForCausalLM, LlamaModel
from .mamba_mixer import FalconMambaMixer, MambaMixer, MixerSizes
from .names import prefix_renamed

RENAMED = (("backbone.embeddings.", "model.embed_tokens."), ("backbone.embedding.", "model.embed_tokens."),
           ("backbone.norm_f.", "model.norm."), ("backbone.", "model."))


def mixer_sizes(config: Any) -> MixerSizes:
    """A Mamba or FalconMamba config's mixer."""
    return MixerSizes(config.hidden_size, config.intermediate_size, config.state_size, config.conv_kernel,
                      int(config.time_step_rank), bool(config.use_bias), bool(config.use_conv_bias),
                      config.hidden_act)


class MambaBlock(nn.Module):
    """One layer: the mixer of the RMSNorm'd residual stream, added to it."""

    def __init__(self, config: Any, ops: Any, mixer: MambaMixer):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon, ops)
        self.mixer = mixer
        self.residual_in_fp32 = bool(config.residual_in_fp32)

    def forward(self, positions, hidden, residual, meta):
        """In the decoders' (hidden, residual) protocol: the residual stream is ``hidden + residual``."""
        if residual is not None:
            hidden = hidden + residual
        residual = hidden.float() if self.residual_in_fp32 else hidden
        return self.mixer(self.norm(hidden.to(self.norm.weight.dtype)), meta), residual


class MambaModel(LlamaModel):
    """The embeddings, the Mamba layers (their mixers from ``make_mixer(config, ops)``) and the final norm."""

    def __init__(self, config: Any, ops: Any, make_mixer: Callable[[Any, Any], MambaMixer]):
        nn.Module.__init__(self)  # not LlamaModel's: no attention, no rotary
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MambaBlock(config, ops, make_mixer(config, ops))
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon, ops)

    def run_layers(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
                   ) -> torch.Tensor:
        """The layers, then the final norm of the (float32) residual stream, in the model's dtype."""
        dtype, residual = hidden.dtype, None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        return self.norm(hidden + residual).to(dtype)


class MambaForCausalLM(LlamaForCausalLM):
    #: the mixers' projections are not split across ranks
    tensor_parallel_plan = None

    def __init__(self, config: Any, ops: Any):
        nn.Module.__init__(self)  # not Llama's: no attention heads, no decoder spec
        self.config = config
        self.ops = ops
        self.model = MambaModel(config, ops, self.make_mixer)
        tie = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, self.model.embed_tokens if tie else None)
        self.num_layers = config.num_hidden_layers

    @staticmethod
    def make_mixer(config: Any, ops: Any) -> MambaMixer:
        return MambaMixer(mixer_sizes(config))

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        return super().load_weights((prefix_renamed(name, RENAMED), tensor) for name, tensor in weights)


class FalconMambaForCausalLM(MambaForCausalLM):
    """Mamba with FalconMamba's mixers (``mixer_rms_eps``)."""

    @staticmethod
    def make_mixer(config: Any, ops: Any) -> MambaMixer:
        return FalconMambaMixer(mixer_sizes(config), config.mixer_rms_eps)
