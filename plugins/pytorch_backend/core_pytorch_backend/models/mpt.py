"""MPT (``MptForCausalLM``: mosaicml/mpt-7b, mpt-30b and their instruct / chat / storywriter fine-tunes, whose
own configs name ``MPTForCausalLM``): Bloom's ALiBi attention (``models.bloom``) with MPT's slopes
(``mpt_alibi_slopes``), no position embeddings, q/k/v fused in ``Wqkv`` in q | k | v order (Llama's
``qkv_proj`` as it is), clamped to ±``clip_qkv`` where set, the scores scaled by ``softmax_scale`` (1 /
sqrt(head_dim) where unset); pre-norm layers of weight-only LayerNorms (``low_precision_layernorm`` is a
LayerNorm computed in the model's dtype), an ungated exact-GELU MLP (``up_proj`` / ``down_proj``), no biases
(``no_bias``), the LM head tied to ``wte``; the context is ``max_seq_len``. Following transformers'
``modeling_mpt``, and MosaicML's own code where transformers reads a field and drops it: the slopes follow
``alibi_bias_max`` (transformers always takes 8, every released checkpoint's) and the logits are multiplied by
``logit_scale`` (a number, or ``inv_sqrt_d_model``). Layouts neither builds are refused at load
(``check_supported``)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import LayerNorm, RotaryEmbedding
from ..quant.attach import QuantizedShards
from .bloom import AlibiAttention, AlibiModel
from .llama import DecoderSpec, LlamaDecoderLayer, LlamaForCausalLM
from .names import parts_renamed
from .rotary_pairs import Weight
from .ungated_mlp import UngatedMLP

RENAMED = (("transformer.wte.", "model.embed_tokens."), ("transformer.norm_f.", "model.norm."),
           ("transformer.blocks.", "model.layers."), (".norm_1.", ".input_layernorm."),
           (".norm_2.", ".post_attention_layernorm."), (".attn.Wqkv.", ".self_attn.qkv_proj."),
           (".attn.out_proj.", ".self_attn.o_proj."), (".ffn.", ".mlp."))
LAYER_NORMS = ("low_precision_layernorm", "layernorm")
GELU = {"name": "gelu", "approximate": "none"}  # llm-foundry's ffn_act_fn default, the MLP's GELU


def mpt_alibi_slopes(num_heads: int, alibi_bias_max: float) -> torch.Tensor:
    """MPT's ``build_mpt_alibi_tensor`` slopes: 1 / 2^(k * alibi_bias_max / p), k = 1..p, for the power of two
    p >= heads; where heads < p, the odd k's first, then the even ones, the first ``heads`` of those."""
    p = 2 ** math.ceil(math.log2(num_heads))
    slopes = 1.0 / torch.pow(2, torch.arange(1, p + 1, dtype=torch.int64).float() * (alibi_bias_max / p))
    if p != num_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:num_heads]
    return slopes


def check_supported(config: Any) -> None:
    """Refuses (NotImplementedError naming the field) the layouts that transformers' MPT does not build."""
    attn = config.attn_config
    refused = {
        "attn_config.attn_type": getattr(attn, "attn_type", "multihead_attention") != "multihead_attention",
        "attn_config.prefix_lm": bool(getattr(attn, "prefix_lm", False)),
        "attn_config.alibi": not getattr(attn, "alibi", True),
        "attn_config.qk_ln": bool(getattr(attn, "qk_ln", False)),
        "attn_config.qk_gn": bool(getattr(attn, "qk_gn", False)),
        "attn_config.rope": bool(getattr(attn, "rope", False)),
        "attn_config.sliding_window_size": getattr(attn, "sliding_window_size", -1) not in (None, -1),
        "attn_config.attn_logit_softcapping": getattr(attn, "attn_logit_softcapping", None) is not None,
        "no_bias": not config.no_bias,
        "expansion_ratio": config.expansion_ratio != 4,
        "norm_type": config.norm_type not in LAYER_NORMS,
        "ffn_config": _ffn_config_refused(getattr(config, "ffn_config", None)),
    }
    for field, refuse in refused.items():
        if refuse:
            raise NotImplementedError(f"MPT: {field}={_value(config, field)!r} is not supported "
                                      "(transformers' MPT builds multi-head ALiBi attention without q/k "
                                      "norms, no biases, a 4 * d_model GELU MLP, LayerNorms)")


def _ffn_config_refused(ffn: dict | None) -> bool:
    """llm-foundry's ffn_config other than MPT's own MLP (``mptmlp`` with exact GELU)."""
    return bool(ffn) and (ffn.get("ffn_type", "mptmlp") != "mptmlp" or ffn.get("ffn_act_fn", GELU) != GELU)


def _value(config: Any, field: str) -> Any:
    for part in field.split("."):
        config = getattr(config, part, None)
    return config


def logit_scale(config: Any) -> float | None:
    """MosaicML's ``logit_scale``: a number, or ``inv_sqrt_d_model`` for 1 / sqrt(d_model); None: unscaled."""
    scale = getattr(config, "logit_scale", None)
    if scale == "inv_sqrt_d_model":
        return 1 / math.sqrt(config.hidden_size)
    if isinstance(scale, str):
        raise ValueError(f"MPT: logit_scale={scale!r} is neither a number nor 'inv_sqrt_d_model'")
    return scale


class MptAttention(AlibiAttention):
    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int,
                 rotary: RotaryEmbedding | None) -> None:
        super().__init__(config, ops, spec, layer_index, rotary)
        self.clip = config.attn_config.clip_qkv

    @staticmethod
    def slopes(config: Any) -> torch.Tensor:
        return mpt_alibi_slopes(config.num_attention_heads, config.attn_config.alibi_bias_max)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        if self.clip:
            qkv = qkv.clamp(-self.clip, self.clip)
        q, k, v = self.qkv_proj.split(qkv)
        return self.o_proj(self.attn(q, k, v, meta))


class MptBlock(LlamaDecoderLayer):
    """Llama's layer (its forward) with weight-only LayerNorms, MPT's attention and its ungated MLP."""

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int,
                 rotary: RotaryEmbedding | None) -> None:
        nn.Module.__init__(self)  # not LlamaDecoderLayer's: its norms are RMSNorms, its MLP gated
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        self.self_attn = MptAttention(config, ops, spec, layer_index, rotary)
        self.mlp = UngatedMLP(hidden, 4 * hidden, "gelu", ("up_proj", "down_proj"), bias=False)
        self.input_layernorm = LayerNorm(hidden, eps, bias=False)
        self.post_attention_layernorm = LayerNorm(hidden, eps, bias=False)


class MptModel(AlibiModel):
    layer_class = MptBlock

    def make_norm(self, config: Any, ops: Any) -> nn.Module:
        return LayerNorm(config.hidden_size, config.layer_norm_epsilon, bias=False)


class MptForCausalLM(LlamaForCausalLM):
    model_class = MptModel
    tensor_parallel_plan = None  # one ALiBi slope per head: not sharded

    def __init__(self, config: Any, ops: Any):
        check_supported(config)
        super().__init__(config, ops)
        self.logit_scale = logit_scale(config)
        self.max_positions = config.max_seq_len  # transformers' ALiBi table holds this many positions

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        return DecoderSpec(qkv_bias=False, qk_norm=False, sliding_windows=(None,) * config.num_hidden_layers,
                           attention_scale=config.attn_config.softmax_scale)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        return logits if self.logit_scale is None else logits * self.logit_scale

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> QuantizedShards:
        return super().load_weights(_ours(weights))


def _ours(weights: Iterable[tuple[str, Weight]]) -> Iterator[tuple[str, Weight]]:
    for name, tensor in weights:
        if name.startswith("transformer.wpe."):
            raise NotImplementedError(f"MPT: {name} (learned position embeddings beside ALiBi) is not "
                                      "supported: transformers' MPT adds no position embeddings")
        yield parts_renamed(name, RENAMED), tensor
