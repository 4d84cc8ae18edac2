"""Gemma 3: the text decoder (``Gemma3ForCausalLM``) and the language model of the vision-language
checkpoint (``Gemma3ForConditionalGeneration``; its vision tower runs in core_vl_models).

What differs from Llama, following transformers' ``modeling_gemma3``:

- RMSNorm scales by ``1 + weight`` in float32 and rounds once (``GemmaRMSNorm``); four norms per layer
  (before and after attention, before and after the MLP), and per-head RMSNorm on q and k;
- embeddings are multiplied by ``sqrt(hidden_size)`` rounded to the model's dtype (image embeddings
  replace rows after the scaling, unscaled);
- a GELU-tanh gated MLP; attention scaled by ``query_pre_attn_scalar ** -0.5``;
- sliding-window layers (``layer_types``) with their own rotary base (10,000) beside the global layers'
  (``rope_parameters`` per layer type, or the older ``rope_local_base_freq``); one rotary table per
  layer type, shared by the layers of that type;
- optional final and attention-logit soft-capping (the attention scores' through the reference op:
  layers.attention); all-bidirectional attention (EmbeddingGemma) is refused with a clear error.

Gemma 2 (models/gemma2.py) is this decoder without the q/k norms, with one rotary table for every layer.

The tokens of one image attend to each other both ways: the vision processor marks the request, the
backend passes the spans to the attention op (``AttentionMetadata.bidirectional_spans``) and the
scheduler keeps each image inside one prefill chunk (``Sequence.atomic_spans``).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import (
    Attention,
    Linear,
    MergedLinear,
    QKVLinear,
    RotaryEmbedding,
    VocabEmbedding,
    get_act_and_mul,
)
from ..layers.rotary import context_positions, rope_parameters
from .llama import DecoderSpec, LlamaModel, head_dim_of, layer_types_of
from .qwen3 import Qwen3ForCausalLM
from .vision_language import VisionLanguageMixin

LAYER_TYPES = ("full_attention", "sliding_attention")
DEFAULT_LOCAL_ROPE_THETA = 10000.0


class GemmaRMSNorm(nn.Module):
    """``norm(x) * (1 + weight)`` computed in float32, rounded to x's dtype once; with ``residual``,
    ``(norm(x + residual), x + residual)`` like the Llama norm, so the decoder loop is shared."""

    def __init__(self, hidden_size: int, eps: float, ops: Any):
        super().__init__()
        self.ops = ops
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
            residual = x
        out = self.ops.rms_norm(x.float(), 1.0 + self.weight.float(), self.eps).to(x.dtype)
        return out if residual is None else (out, residual)


def check_supported(config: Any) -> None:
    """NotImplementedError naming the config field this implementation does not support."""
    if getattr(config, "use_bidirectional_attention", False):
        raise NotImplementedError("Gemma 3: use_bidirectional_attention (an encoder, e.g. EmbeddingGemma) "
                                  "is not supported by a generation backend")
    types = getattr(config, "layer_types", None) or ()
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise NotImplementedError(f"Gemma 3: layer_types {unknown} are not supported (supported: {LAYER_TYPES})")


def rope_parameters_by_layer_type(config: Any) -> dict[str, dict[str, Any]]:
    """Rotary settings of global and sliding layers: transformers 5 nests ``rope_parameters`` by layer
    type; older configs give the global ones (``rope_theta``, ``rope_scaling``) and
    ``rope_local_base_freq`` for the sliding layers."""
    nested = getattr(config, "rope_parameters", None)
    if isinstance(nested, dict) and set(nested) & set(LAYER_TYPES):
        return {t: rope_parameters(SimpleNamespace(rope_parameters=dict(nested.get(t) or {}))) for t in LAYER_TYPES}
    local = getattr(config, "rope_local_base_freq", None) or DEFAULT_LOCAL_ROPE_THETA
    return {"full_attention": rope_parameters(config),
            "sliding_attention": {"rope_type": "default", "rope_theta": float(local)}}


class Gemma3Attention(nn.Module):
    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary_emb: RotaryEmbedding):
        super().__init__()
        self.head_dim = head_dim_of(config)
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.qkv_proj = QKVLinear(config.hidden_size, self.head_dim, heads, kv_heads, bias=spec.qkv_bias)
        self.o_proj = Linear(heads * self.head_dim, config.hidden_size, bias=spec.qkv_bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, ops) if spec.qk_norm else None
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps, ops) if spec.qk_norm else None
        self.rotary_emb = rotary_emb  # shared by the layers of this layer type
        scale = float(getattr(config, "query_pre_attn_scalar", None) or self.head_dim) ** -0.5  # Gemma: head_dim
        self.attn = Attention(heads, kv_heads, self.head_dim, scale, ops, spec.sliding_windows[layer_index],
                              layer_index, softcap=spec.attn_softcap)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        t = q.shape[0]
        q, k = q.reshape(t, -1, self.head_dim), k.reshape(t, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q.reshape(t, -1), k.reshape(t, -1), v, meta))


class Gemma3MLP(nn.Module):
    def __init__(self, config: Any, ops: Any, activation: str | None = None):
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, [inter, inter], ("gate", "up"))
        self.down_proj = Linear(inter, config.hidden_size)
        act = (activation or getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
               or "gelu_pytorch_tanh")
        self.act_fn = get_act_and_mul(act, ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
    """Sandwich norms: ``h += post_attn_norm(attn(input_norm(h)))``, then the same around the MLP.

    Keeps the Llama layers' ``(hidden, residual)`` protocol: the residual stream is ``hidden +
    residual``, so the model's final norm adds the last layer's output in."""

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary_emb: RotaryEmbedding):
        super().__init__()
        self.self_attn = Gemma3Attention(config, ops, spec, layer_index, rotary_emb)
        self.mlp = Gemma3MLP(config, ops)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps, ops)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, ops)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, ops)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, ops)

    def forward(self, positions, hidden, residual, meta):
        if residual is not None:
            hidden = hidden + residual
        residual = hidden
        attn = self.self_attn(self.input_layernorm(hidden), positions, meta)
        hidden = residual + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return self.post_feedforward_layernorm(mlp), hidden


class Gemma3Model(LlamaModel):
    """Embedding (scaled), decoder layers and final norm, with the weight names of HF's Gemma3TextModel;
    the forward pass (embedding overrides, the layer loop, the final norm) is Llama's."""

    layer_class = Gemma3DecoderLayer  # VaultGemma's has two norms a layer

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec):
        nn.Module.__init__(self)  # not LlamaModel's: it would build Llama layers
        check_supported(config)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        # transformers keeps sqrt(hidden_size) as a float32 tensor and rounds it to the weights' dtype
        self.register_buffer("embed_scale", torch.tensor(float(config.hidden_size) ** 0.5), persistent=False)
        head_dim = head_dim_of(config)
        max_positions = context_positions(config)
        ropes = {t: RotaryEmbedding(head_dim, max_positions, params, ops)
                 for t, params in self.rope_parameters_by_layer_type(config).items()}
        self.layers = nn.ModuleList(
            self.layer_class(config, ops, spec, i, ropes[t]) for i, t in enumerate(layer_types_of(config))
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    @staticmethod
    def rope_parameters_by_layer_type(config: Any) -> dict[str, dict[str, Any]]:
        return rope_parameters_by_layer_type(config)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings times sqrt(hidden_size), the factor rounded to the weights' dtype first."""
        hidden = self.embed_tokens(input_ids)
        return hidden * self.embed_scale.to(hidden.dtype)


class Gemma3ForCausalLM(Qwen3ForCausalLM):
    """Gemma 3 text decoder (``model_type`` gemma3_text): Qwen3's decoder spec (attention_bias, windows
    per layer type) over its own decoder stack, with soft-capped logits."""

    model_class = Gemma3Model

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits, soft-capped as ``cap * tanh(logits / cap)`` when the config sets a cap."""
        logits = self.lm_head(hidden)
        cap = getattr(self.config, "final_logit_softcapping", None)
        return logits if not cap else torch.tanh(logits / cap) * cap


class Gemma3ForConditionalGeneration(VisionLanguageMixin, Gemma3ForCausalLM):
    """Gemma 3 vision-language checkpoints: the Gemma 3 text decoder of ``text_config``."""

    text_model_types = ("gemma3_text",)
