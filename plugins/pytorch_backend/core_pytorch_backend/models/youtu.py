"""Youtu-LLM (Tencent, ``YoutuForCausalLM``): DeepSeek-V3's decoder (models/deepseek_v3.py: multi-head latent
attention served over expanded heads, pair rotary where ``rope_interleave``, YaRN's mscale in the softmax scale)
with a dense gated MLP of ``intermediate_size`` on every layer, no experts. Following transformers'
``modeling_youtu``."""

from __future__ import annotations

from .deepseek_v2 import MlaAttention
from .deepseek_v3 import DeepseekV3ForCausalLM
from .llama import LlamaDecoderLayer, LlamaModel


class YoutuDecoderLayer(LlamaDecoderLayer):
    attention_class = MlaAttention


class YoutuModel(LlamaModel):
    layer_class = YoutuDecoderLayer


class YoutuForCausalLM(DeepseekV3ForCausalLM):
    model_class = YoutuModel
