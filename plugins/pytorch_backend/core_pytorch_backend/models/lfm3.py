"""LFM3 (Liquid AI's LFM3-1.7B): LFM2's hybrid of short convolutions and attention (models/lfm2.py), following
transformers' ``modeling_lfm3``, with:

- a third layer type, ``sliding_attention`` (a window of ``sliding_window``), beside "conv" and
  ``full_attention`` (by default three convolutions, then one attention layer, every fourth a full one);
- Qwen3's attention names (``q_norm`` / ``k_norm`` per head, ``o_proj``; ``attention_bias`` on q/k/v/o) and,
  with ``use_attention_gate``, each head's output scaled by ``sigmoid(gate_proj(x))`` (one logit per head of
  the attention's input ``x``; transformers calls it ``g_proj`` and reads the checkpoints' ``gate_proj``);
- a rotary table per attention layer type (``rope_parameters`` nested by it): the sliding layers' default
  frequencies, the full layers' ``proportional`` ones (the first ``partial_rotary_factor`` of each head's
  frequencies rotate, the rest stand still; computed as Gemma 4's, models/gemma4.py ``rope_settings``);
- with ``use_sandwich_norm``, the mixer's and the MLP's outputs normalized before the residual adds them
  (``post_operator_norm``, ``post_ffn_norm``);
- convolutions of ``conv_L_cache`` = 7 taps by default, and MLPs of ``intermediate_size`` as given.
"""

from __future__ import annotations

from typing import Any

import torch

from ..attention_metadata import AttentionMetadata
from ..layers import Linear, RotaryEmbedding
from ..layers.rotary import context_positions
from .gemma4 import ROPE_TYPES, rope_settings
from .lfm2 import Lfm2DecoderLayer, Lfm2ForCausalLM, Lfm2Model, check_layer_types
from .llama import DecoderSpec, LlamaAttention, head_dim_of, layer_types_windows

LAYER_TYPES = ("conv", "full_attention", "sliding_attention")


class Lfm3Attention(LlamaAttention):
    """Llama's attention with per-head q/k norms and, where the config gates it, each head's output times
    ``sigmoid(gate_proj(x))``."""

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding):
        super().__init__(config, ops, spec, layer_index, rotary)
        gated = bool(config.use_attention_gate)
        self.gate_proj = Linear(config.hidden_size, config.num_attention_heads) if gated else None

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.gate_proj is None:
            return super().forward(hidden, positions, meta)
        t = hidden.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q = self.q_norm(q.reshape(t, -1, self.head_dim)).reshape(t, -1)
        k = self.k_norm(k.reshape(t, -1, self.head_dim)).reshape(t, -1)
        q, k = self.rotary_emb(positions, q, k)
        heads = self.attn(q, k, v, meta).reshape(t, -1, self.head_dim)
        gate = torch.sigmoid(self.gate_proj(hidden)).unsqueeze(-1)
        return self.o_proj((heads * gate).reshape(t, -1))


class Lfm3DecoderLayer(Lfm2DecoderLayer):
    attention_class = Lfm3Attention


class Lfm3Model(Lfm2Model):
    layer_class = Lfm3DecoderLayer

    def make_rotaries(self, config: Any, ops: Any) -> list[RotaryEmbedding | None]:
        """One table per attention layer type, shared by its layers; none for the convolutions."""
        head_dim = head_dim_of(config)
        types = config.layer_types
        tables = {t: RotaryEmbedding(head_dim, context_positions(config), rope_settings(config, t, head_dim), ops)
                  for t in set(types) - {"conv"}}
        return [tables.get(t) for t in types]


class Lfm3ForCausalLM(Lfm2ForCausalLM):
    model_class = Lfm3Model
    family = "LFM3"

    @classmethod
    def check_supported(cls, config: Any) -> None:
        check_layer_types(config, cls.family, LAYER_TYPES)
        nested = getattr(config, "rope_parameters", None) or {}
        for layer_type in set(config.layer_types) - {"conv"}:
            params = nested.get(layer_type)
            if not isinstance(params, dict):
                raise NotImplementedError(f"LFM3: rope_parameters has no {layer_type!r} settings (transformers "
                                          "reads them by layer type)")
            if params.get("rope_type", "default") not in ROPE_TYPES:
                raise NotImplementedError(f"LFM3: rope_parameters[{layer_type!r}] rope_type "
                                          f"{params.get('rope_type')!r} is not supported (supported: "
                                          f"{', '.join(ROPE_TYPES)})")

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        bias = bool(config.attention_bias)
        return DecoderSpec(qkv_bias=bias, qk_norm=True, sliding_windows=layer_types_windows(config), o_bias=bias)
