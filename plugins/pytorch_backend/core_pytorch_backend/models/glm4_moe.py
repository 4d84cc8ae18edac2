"""GLM-4.5 / GLM-4.6 (``Glm4MoeForCausalLM``; GLM-4.5-Air too): Llama's layers with q/k/v biases where
``attention_bias`` (never on o_proj), q and k RMS-normalized head by head before rotary where ``use_qk_norm``,
rotary (rotate-half, as GPT-NeoX's, not GLM-4's pairs) on the first ``partial_rotary_factor`` of each head
(0.5 unless the config says otherwise), and the grouped mixture of experts of models/grouped_router.py:
``noaux_tc`` routing, a shared MLP, dense MLPs on the first ``first_k_dense_replace`` layers. The checkpoints'
multi-token-prediction layers (``num_nextn_predict_layers``: ``model.layers.46`` of GLM-4.5-Air, ``92`` of
GLM-4.5) are skipped, as transformers skips them. Following transformers' ``modeling_glm4_moe``."""

from __future__ import annotations

from typing import Any

from .grouped_router import GroupedMoeCheckpoint, GroupedMoeModel
from .llama import DecoderSpec, LlamaForCausalLM


class Glm4MoeModel(GroupedMoeModel):
    partial_rotary = True  # dots1's, on the same model, turns whole heads


class Glm4MoeForCausalLM(GroupedMoeCheckpoint, LlamaForCausalLM):
    model_class = Glm4MoeModel
    #: experts are not split across ranks
    tensor_parallel_plan = None

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        return DecoderSpec(qkv_bias=bool(config.attention_bias), qk_norm=bool(config.use_qk_norm),
                           sliding_windows=(None,) * config.num_hidden_layers)
