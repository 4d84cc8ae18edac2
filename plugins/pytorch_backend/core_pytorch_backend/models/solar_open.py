"""Solar Open (Upstage, ``SolarOpenForCausalLM``): GLM-4.5's mixture of experts (models/grouped_router.py:
``noaux_tc`` routing over ``n_group`` groups, a shared MLP of ``n_shared_experts`` experts' width) on every layer
(no dense first layers), under Llama's attention: q/k/v biases where ``attention_bias`` (never on o_proj), no q/k
norms, Llama's rotary on whole heads. Following transformers' ``modeling_solar_open``."""

from __future__ import annotations

from typing import Any

from torch import nn

from .grouped_router import GroupedMoeBlock, GroupedMoeCheckpoint, GroupedMoeDecoderLayer, GroupedMoeModel
from .llama import DecoderSpec, LlamaForCausalLM


class SolarOpenDecoderLayer(GroupedMoeDecoderLayer):
    def make_mlp(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int) -> nn.Module:
        return GroupedMoeBlock(config, ops, self.routing_rule(config))  # every layer's: its config has no dense


class SolarOpenModel(GroupedMoeModel):
    layer_class = SolarOpenDecoderLayer


class SolarOpenForCausalLM(GroupedMoeCheckpoint, LlamaForCausalLM):
    model_class = SolarOpenModel
    #: experts are not split across ranks
    tensor_parallel_plan = None

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        return DecoderSpec(qkv_bias=bool(config.attention_bias), qk_norm=False,
                           sliding_windows=(None,) * config.num_hidden_layers)
