"""Ministral 3 / Mistral 3 (Mistral AI, 2025; ``Ministral3ForCausalLM``, the text decoder of Mistral 3's
checkpoints): Mistral (no biases, ``sliding_window`` on every layer, YaRN by default) whose q is scaled after
rotary by Llama 4's position-dependent factor ``1 + beta * log(1 + floor(pos / original_max_position_embeddings))``
(``llama_4_scaling_beta`` and the original context from ``rope_parameters``): 1 over the original context,
growing past it. ``Mistral3ForConditionalGeneration`` serves the language model of Mistral 3's vision-language
checkpoints the same way, for text only."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

from ..attention_metadata import AttentionMetadata
from ..layers import RotaryEmbedding
from .llama import DecoderSpec, LlamaAttention, LlamaDecoderLayer, LlamaModel
from .mistral import MistralForCausalLM
from .vision_language import VisionLanguageMixin


def llama4_query_scale(positions: torch.Tensor, beta: float, original: int) -> torch.Tensor:
    """Each position's factor on q, [T, 1], computed as transformers' ``get_llama_4_attn_scale`` does."""
    return (1 + beta * torch.log(1 + torch.floor(positions / original)))[:, None]


@lru_cache(maxsize=4)
def query_scale_table(rows: int, beta: float, original: int, device: torch.device) -> torch.Tensor:
    """The factors of positions 0 .. rows - 1, [rows] float32: one table every layer and step indexes (and the
    native decode stack reads), so that a position's factor does not depend on how many rows a step computes it
    for (torch's vectorized log and its scalar tail may differ in the last bit)."""
    return llama4_query_scale(torch.arange(rows, device=device), beta, original)[:, 0]


class Ministral3Attention(LlamaAttention):
    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding):
        super().__init__(config, ops, spec, layer_index, rotary)
        params = config.rope_parameters or {}
        beta, original = params.get("llama_4_scaling_beta"), params.get("original_max_position_embeddings")
        if beta and not original:
            raise ValueError("Ministral 3: rope_parameters sets llama_4_scaling_beta without "
                             "original_max_position_embeddings")
        self.query_scaling = (float(beta), int(original)) if beta else None

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        q, k = self.rotary_emb(positions, q, k)
        if self.query_scaling is not None:
            q = q * self.query_scales()[positions][:, None].to(q.dtype)
        return self.o_proj(self.attn(q, k, v, meta))

    def query_scales(self) -> torch.Tensor | None:
        """Each position's factor on q up to the rotary table's length, float32 (None: no scaling)."""
        if self.query_scaling is None:
            return None
        table = self.rotary_emb.cos_cache
        return query_scale_table(table.shape[0], *self.query_scaling, table.device)


class Ministral3DecoderLayer(LlamaDecoderLayer):
    attention_class = Ministral3Attention


class Ministral3Model(LlamaModel):
    layer_class = Ministral3DecoderLayer


class Ministral3ForCausalLM(MistralForCausalLM):
    model_class = Ministral3Model


class Mistral3ForConditionalGeneration(VisionLanguageMixin, Ministral3ForCausalLM):
    """The class Mistral 3's released checkpoints name (Ministral 3, Mistral Small 3.1 / 3.2): their language model
    of ``text_config`` (a Ministral 3 or a Mistral decoder, which sets no ``llama_4_scaling_beta``), for text only:
    no vision processor serves Pixtral's tower, so the engine refuses images."""

    text_model_types = ("ministral3", "mistral")
