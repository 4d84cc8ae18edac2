"""Building blocks of the pytorch backend's models; each receives the ops namespace it runs on."""

from .activation import Activation, SiluAndMul, get_act_and_mul
from .attention import (
    Attention,
    allocate_kv_caches,
    attention_layers,
    bind_kv_caches,
    kv_cache_shape,
    unbind_kv_caches,
)
from .embedding import LMHead, VocabEmbedding
from .linear import Linear, MergedLinear, QKVLinear
from .norm import LayerNorm, ParameterFreeLayerNorm, RMSNorm
from .rotary import RotaryEmbedding, get_rope, rope_parameters

__all__ = [
    "Activation",
    "Attention",
    "LMHead",
    "LayerNorm",
    "Linear",
    "MergedLinear",
    "ParameterFreeLayerNorm",
    "QKVLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "SiluAndMul",
    "VocabEmbedding",
    "allocate_kv_caches",
    "attention_layers",
    "bind_kv_caches",
    "get_act_and_mul",
    "get_rope",
    "kv_cache_shape",
    "rope_parameters",
    "unbind_kv_caches",
]
