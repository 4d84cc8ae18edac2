"""EXAONE 4.0 (LG AI Research): OLMo 2's post-norm layers (``models.olmo2``) with q and k RMS-normalized head by
head before rotary, and, where the config sets a sliding window, windowed layers as ``layer_types`` says that
take rotary and global layers that take none (EXAONE 4.0 32B's 3:1 pattern); every layer takes rotary where
it sets no window (1.2B)."""

from __future__ import annotations

from typing import Any

from .llama import DecoderSpec, LlamaAttention, LlamaForCausalLM, layer_types_of, layer_types_windows
from .olmo2 import Olmo2DecoderLayer, Olmo2Model


class Exaone4DecoderLayer(Olmo2DecoderLayer):
    attention_class = LlamaAttention  # its q / k norms per head (spec.qk_norm), before rotary


class Exaone4Model(Olmo2Model):
    layer_class = Exaone4DecoderLayer


class Exaone4ForCausalLM(LlamaForCausalLM):
    model_class = Exaone4Model
    tensor_parallel_plan = None

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        windowed = getattr(config, "sliding_window", None) is not None
        rope = None if not windowed else tuple(t == "sliding_attention" for t in layer_types_of(config))
        return DecoderSpec(qkv_bias=False, qk_norm=True, rope_layers=rope,
                           sliding_windows=layer_types_windows(config) if windowed else (None,) * config.num_hidden_layers)
