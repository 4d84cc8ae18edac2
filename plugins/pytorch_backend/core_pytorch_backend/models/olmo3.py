"""OLMo 3 (AI2): OLMo 2 (``models.olmo2``) with sliding windows on the layers ``layer_types`` names (three of every
four by default) and rotary settings per layer type (``rope_parameters`` nested by it, as transformers 5 keeps
them: a long-context YaRN scales the global layers' frequencies, not the windowed ones')."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from ..layers import RotaryEmbedding
from ..layers.rotary import context_positions, rope_parameters
from .llama import DecoderSpec, head_dim_of, layer_types_of, layer_types_windows
from .olmo2 import Olmo2ForCausalLM, Olmo2Model


def rope_parameters_of(config: Any, layer_type: str) -> dict[str, Any]:
    """The rotary settings of ``layer_type``'s layers: their nested entry where the config nests them."""
    nested = getattr(config, "rope_parameters", None)
    if isinstance(nested, dict) and isinstance(nested.get(layer_type), dict):
        return rope_parameters(SimpleNamespace(rope_parameters=dict(nested[layer_type])))
    return rope_parameters(config)


class Olmo3Model(Olmo2Model):
    def make_rotaries(self, config: Any, ops: Any) -> list[RotaryEmbedding]:
        types = layer_types_of(config)
        tables = {t: RotaryEmbedding(head_dim_of(config), context_positions(config), rope_parameters_of(config, t), ops)
                  for t in set(types)}
        return [tables[t] for t in types]


class Olmo3ForCausalLM(Olmo2ForCausalLM):
    model_class = Olmo3Model

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderSpec(qkv_bias=bias, qk_norm=False, sliding_windows=layer_types_windows(config), o_bias=bias)
