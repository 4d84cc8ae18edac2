"""Persimmon (Adept's Persimmon-8B; Fuyu's language model): GPT-NeoX's layers (models/gpt_neox.py: q/k/v fused head
by head in ``query_key_value``, rotary on ``partial_rotary_factor`` of each head, LayerNorms, biases) in sequence,
not side by side, with a LayerNorm per head of q and of k before rotary (``qk_layernorm``) and a relu² MLP, under
Llama's checkpoint names (``model.embed_tokens``, ``self_attn``, ``lm_head``; ``model.final_layernorm`` read as
``model.norm``). Following transformers' ``modeling_persimmon``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..quant.attach import QuantizedShards
from .gpt_neox import GPTNeoXForCausalLM
from .names import parts_renamed

RENAMED = (("model.final_layernorm.", "model.norm."),)


class PersimmonForCausalLM(GPTNeoXForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        return super().load_weights((parts_renamed(name, RENAMED), tensor) for name, tensor in weights)
