"""OLMo Hybrid (``OlmoHybridForCausalLM``: Olmo-Hybrid-7B), following transformers' ``modeling_olmo_hybrid``:
gated DeltaNet layers (models/gated_deltanet.py) and OLMo 3's attention layers, by ``layer_types`` (every
fourth layer attention by default).

- A DeltaNet layer is pre-norm (Llama's RMSNorms, ``input_layernorm`` / ``post_attention_layernorm``,
  which the checkpoints name ``attention_layer_norm`` / ``feedforward_layer_norm``) with a gated MLP; its
  mixer projects q, k and v apart (read into one ``qkv_proj``), the output gate (``g_proj``), ``b_proj``
  and ``a_proj``; its step size is ``2 * sigmoid(b)`` where ``linear_allow_neg_eigval`` (the default); its
  output norm's eps is 1e-5 (FLA's, whatever ``rms_norm_eps``) and its names ``o_norm`` / ``o_proj``. The
  checkpoints keep the convolution's q, k and v weights apart (``q_conv1d`` ...): joined at load.
- An attention layer is OLMo 2's post-norm layer (models/olmo2.py: q and k RMS-normalized over their whole
  projection), without rotary where the rotary settings name no ``rope_theta`` (NoPE, as the released
  checkpoint: transformers then builds no rotary embedding).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import Linear, MergedLinear, VocabEmbedding, get_rope
from ..quant.attach import QuantizedShards
from .gated_deltanet import GatedDeltaNet, HybridDecoderLayer, hybrid_layer_types
from .llama import DecoderSpec, LlamaForCausalLM, LlamaModel, head_dim_of
from .names import parts_renamed
from .olmo2 import Olmo2Attention, Olmo2DecoderLayer

OUTPUT_NORM_EPS = 1e-5  # the DeltaNet's output norm (transformers: FLA's FusedRMSNormGated default)
# the checkpoints' names read as this model's (the first two as transformers' conversion reads them)
RENAMED = ((".attention_layer_norm.", ".input_layernorm."),
           (".feedforward_layer_norm.", ".post_attention_layernorm."),
           (".linear_attn.o_proj.", ".linear_attn.out_proj."), (".linear_attn.o_norm.", ".linear_attn.norm."))
_CONV_PART = re.compile(r"^(.*\.linear_attn\.)([qkv])_conv1d\.weight$")


def uses_rope(config: Any) -> bool:
    """Whether attention rotates q and k: rotary settings with a ``rope_theta`` (else NoPE)."""
    params = getattr(config, "rope_parameters", None)
    return isinstance(params, dict) and params.get("rope_theta") is not None


class OlmoHybridGatedDeltaNet(GatedDeltaNet):
    def __init__(self, config: Any):
        super().__init__(config, OUTPUT_NORM_EPS, 2.0 if config.linear_allow_neg_eigval else 1.0)
        hidden = config.hidden_size
        self.qkv_proj = MergedLinear(hidden, self.sizes, ("q", "k", "v"))
        self.g_proj = Linear(hidden, self.sizes[2])
        self.b_proj = Linear(hidden, self.value_heads)
        self.a_proj = Linear(hidden, self.value_heads)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.qkv_proj(hidden), self.g_proj(hidden), self.b_proj(hidden), self.a_proj(hidden)


class OlmoHybridAttention(Olmo2Attention):
    """OLMo 2's attention, rotating q and k only where the layer has a rotary table."""

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta))


class OlmoHybridAttentionLayer(Olmo2DecoderLayer):
    attention_class = OlmoHybridAttention


class OlmoHybridLinearLayer(HybridDecoderLayer):
    mixer_class = OlmoHybridGatedDeltaNet


class OlmoHybridModel(LlamaModel):
    def __init__(self, config: Any, ops: Any, spec: DecoderSpec):
        nn.Module.__init__(self)  # not LlamaModel's: two layer classes, by layer type
        types = hybrid_layer_types(config, "OLMo Hybrid")
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        rotary = get_rope(config, head_dim_of(config), ops, self.partial_rotary) if uses_rope(config) else None
        self.layers = nn.ModuleList(
            (OlmoHybridLinearLayer if kind == "linear_attention" else OlmoHybridAttentionLayer)(
                config, ops, spec, index, rotary)
            for index, kind in enumerate(types))
        self.norm = self.make_norm(config, ops)


class OlmoHybridForCausalLM(LlamaForCausalLM):
    model_class = OlmoHybridModel
    #: recurrent layers, and q / k normalized over every head at once: not split across ranks
    tensor_parallel_plan = None

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))
        layers = config.num_hidden_layers
        return DecoderSpec(qkv_bias=bias, qk_norm=False, sliding_windows=(None,) * layers, o_bias=bias,
                           rope_layers=(uses_rope(config),) * layers)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        renamed = ((parts_renamed(name, RENAMED), tensor) for name, tensor in weights)
        return super().load_weights(joined_convolutions(renamed))


def joined_convolutions(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Each DeltaNet's ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d`` weights as one ``conv1d.weight`` [q | k | v]
    (once the three are read); the rest as is."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        match = _CONV_PART.match(name)
        if match is None:
            yield name, tensor
            continue
        prefix, part = match.groups()
        found = parts.setdefault(prefix, {})
        found[part] = tensor
        if len(found) == 3:
            yield f"{prefix}conv1d.weight", torch.cat([found[p] for p in "qkv"])
            del parts[prefix]
