"""MiniCPM3 (``MiniCPM3ForCausalLM``: openbmb/MiniCPM3-4B): DeepSeek-V2's multi-head latent attention
(models/deepseek_v2.py's ``MlaAttention``, q LoRA where ``q_lora_rank``, the expanded heads in the KV cache) with
rotate-half rotary (no pair reordering), Llama's gated MLP (biases where ``mlp_bias``), and Granite's scalings
(models/granite.py): the embeddings times ``scale_emb``, what each attention and MLP adds to the residual times
``scale_depth / sqrt(num_hidden_layers)``, and the final hidden states divided by ``hidden_size / dim_model_base``
before the LM head. Following transformers' ``modeling_minicpm3``."""

from __future__ import annotations

import math
from typing import Any

import torch

from .deepseek_v2 import MlaAttention, MlaCache
from .granite import GraniteDecoderLayer
from .llama import LlamaForCausalLM, LlamaModel


class MiniCPM3DecoderLayer(GraniteDecoderLayer):
    attention_class = MlaAttention

    @classmethod
    def residual_multiplier_of(cls, config: Any) -> float:
        return config.scale_depth / math.sqrt(config.num_hidden_layers)


class MiniCPM3Model(LlamaModel):
    layer_class = MiniCPM3DecoderLayer

    def __init__(self, config: Any, *args: Any) -> None:
        super().__init__(config, *args)
        self.scale_emb = float(config.scale_emb)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.scale_emb


class MiniCPM3ForCausalLM(MlaCache, LlamaForCausalLM):
    model_class = MiniCPM3Model
    #: MLA's heads are not split across ranks
    tensor_parallel_plan = None

    def __init__(self, config: Any, ops: Any) -> None:
        super().__init__(config, ops)
        self.logits_scaling = config.hidden_size / config.dim_model_base

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden / self.logits_scaling)
