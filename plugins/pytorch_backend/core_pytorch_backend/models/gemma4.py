"""Gemma 4: the text decoder (``Gemma4ForCausalLM``, ``model_type`` gemma4_text) and the language model of the
released checkpoints (``Gemma4ForConditionalGeneration``: gemma-4-E2B / E4B / 26B-A4B / 31B, served for text
only), following transformers' ``modeling_gemma4``. Gemma 3's layout (models/gemma3.py: sandwich norms, a
scaled embedding, sliding and global layers by ``layer_types``, soft-capped logits) with:

- layers of two geometries (transformers' ``per_layer_config``): sliding layers of ``head_dim`` and
  ``num_key_value_heads``, global layers of ``global_head_dim`` and, with ``attention_k_eq_v``, of
  ``num_global_key_value_heads``, whose values are the keys' projection (no ``v_proj``); so the layers'
  KV caches differ in shape (``layers.attention.allocate_kv_caches`` gives each its own);
- q and k RMS-normalized per head with weights, v without, and attention scores not scaled (scale 1);
- a rotary table per layer type: the sliding layers' default frequencies, the global layers'
  ``proportional`` ones (the first ``partial_rotary_factor`` of each head's frequencies rotate, the rest
  are 0: served as default frequencies with the others divided by infinity, ``rope_freq_factors``);
- ``num_kv_shared_layers``: the last layers compute no K/V and read the KV cache of the last earlier layer
  of their type (``Attention.kv_source``); with ``use_double_wide_mlp`` their MLPs are twice as wide;
- per-layer inputs (PLE, ``hidden_size_per_layer_input``): each token's row of ``embed_tokens_per_layer``
  (scaled by ``sqrt(hidden_size_per_layer_input)``) plus a normalized projection of its embedding, one
  slice per layer, which gates a branch each layer adds to its output (E2B, E4B);
- a mixture of experts beside the MLP (``enable_moe_block``, models/gemma4_layers.py);
- each layer's output multiplied by its ``layer_scalar``.

The checkpoints' vision and audio towers are skipped at load; no vision processor is registered for the
architecture, so the engine refuses a request with images before it reaches the backend ("is a text-only
model and does not accept images"), and the model refuses image embeddings. A text-only prompt's image,
video and audio placeholder tokens are read as the pad token, as transformers reads them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import Activation, Attention, Linear, LMHead, MergedLinear, RotaryEmbedding, VocabEmbedding
from ..layers.rotary import context_positions
from ..quant.attach import QuantizedShards
from .gemma3 import LAYER_TYPES, Gemma3ForCausalLM, Gemma3Model
from .gemma4_layers import (
    Gemma4Experts,
    Gemma4RMSNorm,
    Gemma4Router,
    gemma4_mlp,
    unit_rms_norm,
)
from .names import prefix_renamed
from .sparse_moe import experts_one_by_one
from .vision_language import VisionLanguageMixin

ROPE_TYPES = ("default", "proportional")
KV_SHARED_UNUSED = ("k_proj", "v_proj", "k_norm", "v_norm")  # transformers ignores these of a KV-shared layer
TOWER_PREFIXES = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")


@dataclass(frozen=True)
class LayerPlan:
    """What differs between Gemma 4's layers."""

    layer_type: str
    head_dim: int
    kv_heads: int
    window: int | None
    values_are_keys: bool  # attention_k_eq_v on a global layer
    kv_source: int | None  # the earlier layer whose KV cache this one reads (num_kv_shared_layers)
    mlp_size: int


def check_supported(config: Any) -> None:
    """NotImplementedError naming the config field this implementation does not serve."""
    if config.use_bidirectional_attention == "all":
        raise NotImplementedError("Gemma 4: use_bidirectional_attention 'all' (an encoder) is not supported "
                                  "by a generation backend")
    unknown = sorted(set(config.layer_types) - set(LAYER_TYPES))
    if unknown:
        raise NotImplementedError(f"Gemma 4: layer_types {unknown} are not supported "
                                  f"(supported: {LAYER_TYPES})")
    if config.hidden_size_per_layer_input and config.vocab_size_per_layer_input < config.vocab_size:
        raise NotImplementedError(f"Gemma 4: vocab_size_per_layer_input {config.vocab_size_per_layer_input} "
                                  f"below vocab_size {config.vocab_size}")


def layer_plans(config: Any) -> list[LayerPlan]:
    """Each layer's geometry (``per_layer_config``), window, KV source and MLP width."""
    types = list(config.layer_types)
    shared = config.num_kv_shared_layers or 0
    first_shared = config.num_hidden_layers - shared
    plans = []
    for index, layer_type in enumerate(types):
        layer = config.per_layer_config[index]
        source = _kv_source(types, first_shared, index, shared) if index >= first_shared else None
        wide = config.use_double_wide_mlp and source is not None
        plans.append(LayerPlan(layer_type, layer.head_dim, layer.num_key_value_heads,
                               config.sliding_window if layer_type == "sliding_attention" else None,
                               bool(config.attention_k_eq_v) and layer_type == "full_attention", source,
                               config.intermediate_size * (2 if wide else 1)))
    return plans


def _kv_source(types: list[str], first_shared: int, index: int, shared: int) -> int:
    """The last layer before the shared ones of layer ``index``'s type (transformers' "store" layer)."""
    earlier = [j for j in range(first_shared) if types[j] == types[index]]
    if not earlier:
        raise NotImplementedError(f"Gemma 4: num_kv_shared_layers {shared} leaves layer {index} "
                                  f"({types[index]}) no earlier layer of its type to read the KV cache of")
    return earlier[-1]


def rope_settings(config: Any, layer_type: str, head_dim: int) -> dict[str, Any]:
    """``rope_parameters[layer_type]`` as settings ``layers.rotary`` computes: ``proportional`` is the default
    frequencies of the whole head with all but the first ``partial_rotary_factor`` of them set to 0 (divided
    by infinity) and every one divided by ``factor``, as transformers computes it."""
    params = (config.rope_parameters or {}).get(layer_type)
    if not isinstance(params, dict):
        raise NotImplementedError(f"Gemma 4: rope_parameters without {layer_type!r} settings (transformers "
                                  "reads them by layer type)")
    rope_type = params.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise NotImplementedError(f"Gemma 4: rope_parameters[{layer_type!r}] rope_type {rope_type!r} is not "
                                  f"supported (supported: {', '.join(ROPE_TYPES)})")
    settings = {"rope_type": "default", "rope_theta": float(params["rope_theta"])}
    if rope_type == "proportional":
        rotated = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
        factor = float(params.get("factor", 1.0))
        settings["rope_freq_factors"] = [factor] * rotated + [math.inf] * (head_dim // 2 - rotated)
    return settings


class Gemma4Attention(nn.Module):
    """q/k/v (q/k where values are keys, q alone in a KV-shared layer) fused as ``qkv_proj``."""

    def __init__(self, config: Any, ops: Any, plan: LayerPlan, layer_index: int, rotary_emb: RotaryEmbedding):
        super().__init__()
        self.head_dim, heads, bias = plan.head_dim, config.num_attention_heads, config.attention_bias
        shared = plan.kv_source is not None
        shards = ("q",) if shared else ("q", "k") if plan.values_are_keys else ("q", "k", "v")
        sizes = [heads * plan.head_dim] + [plan.kv_heads * plan.head_dim] * (len(shards) - 1)
        self.qkv_proj = MergedLinear(config.hidden_size, sizes, shards, bias=bias)
        self.o_proj = Linear(heads * plan.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Gemma4RMSNorm(plan.head_dim, config.rms_norm_eps, ops)
        self.k_norm = None if shared else Gemma4RMSNorm(plan.head_dim, config.rms_norm_eps, ops)
        self.eps = config.rms_norm_eps
        self.rotary_emb = rotary_emb  # shared by the layers of this layer type
        self.attn = Attention(heads, plan.kv_heads, plan.head_dim, 1.0, ops, plan.window, layer_index,
                              kv_source=plan.kv_source)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        parts = self.qkv_proj.split(self.qkv_proj(hidden))
        t = hidden.shape[0]
        q = self.q_norm(parts[0].reshape(t, -1, self.head_dim))
        if self.attn.kv_source is not None:  # its source layer stored this step's K/V
            q, _ = self.rotary_emb(positions, q, q[:, :1])  # rotary rotates a k too: one head, dropped
            return self.o_proj(self.attn(q.reshape(t, -1), None, None, meta))
        k = parts[1].reshape(t, -1, self.head_dim)
        v = unit_rms_norm(parts[2].reshape(t, -1, self.head_dim) if len(parts) == 3 else k, self.eps)
        q, k = self.rotary_emb(positions, q, self.k_norm(k))
        return self.o_proj(self.attn(q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1), meta))


class Gemma4DecoderLayer(nn.Module):
    """Sandwich norms around attention and the MLP (and the experts beside it), then the per-layer input's
    branch, all times ``layer_scalar``; the residual stream is ``hidden`` itself."""

    def __init__(self, config: Any, ops: Any, plan: LayerPlan, layer_index: int, rotary_emb: RotaryEmbedding):
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma4Attention(config, ops, plan, layer_index, rotary_emb)
        self.mlp = gemma4_mlp(config, ops, plan.mlp_size)
        self.input_layernorm = Gemma4RMSNorm(size, eps, ops)
        self.post_attention_layernorm = Gemma4RMSNorm(size, eps, ops)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(size, eps, ops)
        self.post_feedforward_layernorm = Gemma4RMSNorm(size, eps, ops)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)
        self.router = Gemma4Router(config) if config.enable_moe_block else None
        if self.router is not None:
            self.experts = Gemma4Experts(config, ops)
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(size, eps, ops)
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(size, eps, ops)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(size, eps, ops)
        per_layer = config.hidden_size_per_layer_input
        self.per_layer_input_gate = Linear(size, per_layer) if per_layer else None
        if per_layer:
            self.per_layer_projection = Linear(per_layer, size)
            self.post_per_layer_input_norm = Gemma4RMSNorm(size, eps, ops)
            self.per_layer_act = Activation(config.hidden_activation)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, per_layer_input: torch.Tensor | None,
                meta: AttentionMetadata) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(hidden), positions, meta)
        hidden = hidden + self.post_attention_layernorm(attn)
        out = self.mlp(self.pre_feedforward_layernorm(hidden))
        if self.router is not None:
            experts = self.experts(self.pre_feedforward_layernorm_2(hidden), *self.router(hidden))
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(experts)
        hidden = hidden + self.post_feedforward_layernorm(out)
        if self.per_layer_input_gate is not None:
            gated = self.per_layer_act(self.per_layer_input_gate(hidden)) * per_layer_input
            hidden = hidden + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return hidden * self.layer_scalar


class Gemma4Model(Gemma3Model):
    """Embedding (scaled as Gemma 3's), per-layer inputs, decoder layers and final norm, with the weight names
    of transformers' Gemma4TextModel."""

    def __init__(self, config: Any, ops: Any):
        nn.Module.__init__(self)  # not Gemma3Model's: it would build Gemma 3 layers
        check_supported(config)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.register_buffer("embed_scale", torch.tensor(float(config.hidden_size) ** 0.5), persistent=False)
        plans = layer_plans(config)
        heads = {plan.layer_type: plan.head_dim for plan in plans}
        ropes = {t: RotaryEmbedding(d, context_positions(config), rope_settings(config, t, d), ops)
                 for t, d in heads.items()}
        self.layers = nn.ModuleList(Gemma4DecoderLayer(config, ops, plan, i, ropes[plan.layer_type])
                                    for i, plan in enumerate(plans))
        self.norm = Gemma4RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.per_layer = config.hidden_size_per_layer_input
        if self.per_layer:
            width = config.num_hidden_layers * self.per_layer
            self.embed_tokens_per_layer = VocabEmbedding(config.vocab_size_per_layer_input, width)
            self.register_buffer("per_layer_embed_scale", torch.tensor(float(self.per_layer) ** 0.5),
                                 persistent=False)
            self.per_layer_model_projection = Linear(config.hidden_size, width)
            self.per_layer_projection_norm = Gemma4RMSNorm(self.per_layer, config.rms_norm_eps, ops)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                embed_overrides: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if embed_overrides is not None:
            raise NotImplementedError("Gemma 4: image and audio embeddings are not supported (its language "
                                      "model is served for text only)")
        hidden = self.embed(input_ids)
        per_layer = self.per_layer_inputs(input_ids, hidden) if self.per_layer else None
        for index, layer in enumerate(self.layers):
            hidden = layer(positions, hidden, None if per_layer is None else per_layer[:, index], meta)
        return self.norm(hidden)

    def per_layer_inputs(self, input_ids: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """[T, layers, hidden_size_per_layer_input]: ``(norm(projection(embedded) / sqrt(hidden_size)) +
        embed_tokens_per_layer(ids) * sqrt(hidden_size_per_layer_input)) / sqrt(2)``, in transformers'
        order."""
        rows = (input_ids.shape[0], len(self.layers), self.per_layer)
        tokens = self.embed_tokens_per_layer(input_ids)
        tokens = (tokens * self.per_layer_embed_scale.to(tokens.dtype)).reshape(rows)
        projected = self.per_layer_model_projection(embedded) * embedded.shape[-1] ** -0.5
        return (self.per_layer_projection_norm(projected.reshape(rows)) + tokens) * 2.0**-0.5


class Gemma4ForCausalLM(Gemma3ForCausalLM):
    """Gemma 4 text decoder: its own decoder stack under Gemma 3's soft-capped logits."""

    #: heads of two geometries, per-layer inputs and KV-shared layers: not sharded yet
    tensor_parallel_plan = None

    def __init__(self, config: Any, ops: Any):
        nn.Module.__init__(self)  # not LlamaForCausalLM's: it reads one head geometry for every layer
        self.config = config
        self.ops = ops
        self.model = Gemma4Model(config, ops)
        tie = bool(config.tie_word_embeddings)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, self.model.embed_tokens if tie else None)
        self.num_layers = config.num_hidden_layers

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        """Stacked experts read one by one; a KV-shared layer's K/V weights skipped, as transformers does."""
        unused = tuple(f"model.layers.{i}.self_attn.{name}." for i, layer in enumerate(self.model.layers)
                       if layer.self_attn.attn.kv_source is not None for name in KV_SHARED_UNUSED)
        kept = ((name, tensor) for name, tensor in weights if not name.startswith(unused))
        return super().load_weights(experts_one_by_one(kept))


class Gemma4ForConditionalGeneration(VisionLanguageMixin, Gemma4ForCausalLM):
    """The released Gemma 4 checkpoints' language model (``text_config``), for text-only requests."""

    text_model_types = ("gemma4_text",)

    def __init__(self, config: Any, ops: Any):
        super().__init__(config, ops)
        self.pad_id = self.config.pad_token_id
        tokens = (config.image_token_id, config.video_token_id, config.audio_token_id)
        placeholders = [] if self.pad_id is None else [token for token in tokens if token is not None]
        self.register_buffer("placeholder_ids", torch.tensor(placeholders, dtype=torch.int64),
                             persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                embed_overrides: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Image, video and audio placeholder tokens read as the pad token (as transformers reads text)."""
        if self.placeholder_ids.numel():
            input_ids = torch.where(torch.isin(input_ids, self.placeholder_ids), self.pad_id, input_ids)
        return super().forward(input_ids, positions, meta, embed_overrides)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        """The language model's tensors under the text model's names; the vision and audio towers skipped."""
        return Gemma4ForCausalLM.load_weights(self, language_model_weights(weights))


def language_model_weights(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """``model.language_model.*`` as ``model.*``, the towers and their embedders dropped, the rest as is."""
    for name, tensor in weights:
        if not name.startswith(TOWER_PREFIXES):
            yield prefix_renamed(name, (("model.language_model.", "model."),)), tensor
