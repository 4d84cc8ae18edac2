"""Phi-3 (Phi-3-mini-4k and Phi-3-medium-4k style): Llama whose checkpoints store q/k/v and gate/up fused, as
the model keeps them (``qkv_proj``, ``gate_up_proj``), with ``sliding_window`` on every layer when set.
Rotary with default, linear, llama3, yarn or longrope frequencies, on whole heads or part of each
(``partial_rotary_factor``); the LongRoPE of the 128k variants, Phi-3.5 and Phi-4-mini over its original
context, where transformers keeps its short factors (layers.rotary)."""

from __future__ import annotations

from typing import Any

from .llama import DecoderSpec, LlamaForCausalLM, LlamaModel


class Phi3Model(LlamaModel):
    partial_rotary = True  # Phi-4-mini's 0.75


class Phi3ForCausalLM(LlamaForCausalLM):
    model_class = Phi3Model
    #: the fused weights have no q/k/v or gate/up shards of their own to split across ranks
    tensor_parallel_plan = None

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        window = getattr(config, "sliding_window", None)
        return DecoderSpec(qkv_bias=False, qk_norm=False, sliding_windows=(window,) * config.num_hidden_layers)
