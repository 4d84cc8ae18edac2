"""DeepSeek-V3 (``DeepseekV3ForCausalLM``: DeepSeek-V3, V3.1, R1, Kimi K2, Moonlight): DeepSeek-V2's decoder
(models/deepseek_v2.py: multi-head latent attention, the expanded heads in the KV cache) with ``noaux_tc``
routing (models/grouped_router.py), rotary on pairs of adjacent values only where ``rope_interleave`` (the
default; rotate-half otherwise), and the checkpoints' multi-token-prediction layer (``model.layers.61``) skipped.

The released checkpoints are FP8: ``quantization_config`` {``quant_method``: fp8, ``weight_block_size``:
[128, 128]}: the loader dequantizes them for any architecture (quant/fp8_blocks.py); activations are not
quantized (DeepSeek's FP8 inference quantizes them per group of 128, so its numbers differ slightly)."""

from __future__ import annotations

from typing import Any

from .deepseek_v2 import DeepseekV2DecoderLayer, DeepseekV2ForCausalLM
from .grouped_router import GroupedRouting, noaux_tc_routing
from .llama import LlamaModel


class DeepseekV3DecoderLayer(DeepseekV2DecoderLayer):
    def routing_rule(self, config: Any) -> GroupedRouting:
        return noaux_tc_routing(config)


class DeepseekV3Model(LlamaModel):
    layer_class = DeepseekV3DecoderLayer


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    model_class = DeepseekV3Model

    @classmethod
    def check_routing(cls, config: Any) -> None:
        method = getattr(config, "topk_method", None)
        if method not in (None, "noaux_tc"):
            raise NotImplementedError(f"DeepseekV3: topk_method {method!r} is not supported (transformers' "
                                      "DeepSeek-V3 routes by noaux_tc alone)")

    @classmethod
    def rope_interleaved(cls, config: Any) -> bool:
        return bool(config.rope_interleave)


class Glm4MoeLiteForCausalLM(DeepseekV3ForCausalLM):
    """GLM-4.7-Flash (``Glm4MoeLiteForCausalLM``): DeepSeek-V3's decoder (MLA, ``noaux_tc`` routing, pair rotary
    where ``rope_interleave``) whose dense layers are those ``mlp_layer_types`` names (the first, by default), as
    transformers' ``modeling_glm4_moe_lite``; its multi-token-prediction layer (``model.layers.47``) skipped."""

