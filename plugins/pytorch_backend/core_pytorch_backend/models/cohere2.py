"""Command R7B / Command A (``Cohere2ForCausalLM``): Cohere (``models.cohere``, without q/k norms) whose
layers ``layer_types`` windows (``sliding_window``: three in four in the released checkpoints) take rotary
and whose global layers take none (no layer takes any where ``sliding_window`` is unset, as transformers)."""

from __future__ import annotations

from typing import Any

from .cohere import CohereForCausalLM
from .llama import DecoderSpec, layer_types_windows


class Cohere2ForCausalLM(CohereForCausalLM):
    def __init__(self, config: Any, ops: Any):
        config.use_qk_norm = False  # transformers' Cohere2 attention has none, whatever the config says
        super().__init__(config, ops)

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))
        windows = layer_types_windows(config)
        return DecoderSpec(qkv_bias=bias, qk_norm=False, sliding_windows=windows, o_bias=bias,
                           rope_layers=tuple(w is not None for w in windows))
