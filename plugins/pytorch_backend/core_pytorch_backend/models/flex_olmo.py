"""FlexOlmo (``FlexOlmoForCausalLM``, AI2): OLMo 2's post-norm layers (models/olmo2.py: what the attention and the MLP
return is normalized before it joins the residual; q and k RMS-normalized over their whole projection before
rotary) whose every MLP is OLMoE's mixture of experts (models/sparse_moe.py): ``num_experts`` SwiGLU experts of
``intermediate_size``, each token through its ``num_experts_per_tok`` best by softmax probability, renormalized
where ``norm_topk_prob``. Following transformers' ``modeling_flex_olmo``."""

from __future__ import annotations

from typing import Any

from torch import nn

from .olmo2 import Olmo2DecoderLayer, Olmo2ForCausalLM, Olmo2Model
from .sparse_moe import SparseMoeBlock


class FlexOlmoDecoderLayer(Olmo2DecoderLayer):
    def make_mlp(self, config: Any, ops: Any) -> nn.Module:
        return SparseMoeBlock(config, ops, config.num_experts, config.num_experts_per_tok, config.intermediate_size,
                              normalize=bool(config.norm_topk_prob))


class FlexOlmoModel(Olmo2Model):
    layer_class = FlexOlmoDecoderLayer


class FlexOlmoForCausalLM(Olmo2ForCausalLM):
    model_class = FlexOlmoModel
