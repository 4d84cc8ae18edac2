"""Llama-family decoder (Llama 2/3, SmolLM2); Qwen2/Qwen3/Mistral/SmolLM3/Granite are thin variations of it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import (
    Attention,
    LayerNorm,
    Linear,
    LMHead,
    MergedLinear,
    QKVLinear,
    RMSNorm,
    RotaryEmbedding,
    VocabEmbedding,
    get_act_and_mul,
    get_rope,
)
from ..native.half_weights import HalfWeight
from ..quant.affine import AffineWeight
from ..quant.attach import QuantizedShards, attach_when_complete

# (fused module, HF module, shard) for HF's separate projections that we keep merged.
STACKED_PARAMS = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", "gate"),
    (".gate_up_proj.", ".up_proj.", "up"),
)
SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


@dataclass(frozen=True)
class DecoderSpec:
    """What distinguishes the Llama-like variants from each other."""

    qkv_bias: bool
    qk_norm: bool
    sliding_windows: tuple[int | None, ...]  # one per layer
    o_bias: bool = False  # Llama's and Qwen3's attention_bias covers o_proj too; Qwen2's q/k/v biases do not
    rope_layers: tuple[bool, ...] | None = None  # per layer, whether it applies rotary (None: every layer)
    attention_scale: float | None = None  # the softmax scale (None: head_dim ** -0.5; Granite sets its own)
    mlp_bias: bool = False  # Llama's mlp_bias (most families' MLPs have no biases whatever the config says)
    attn_softcap: float | None = None  # Gemma 2's attn_logit_softcapping (Gemma 3's attention ignores it)
    attn_sinks: bool = False  # gpt-oss's per-head sink logits (Attention's sinks, loaded as self_attn.attn.sinks)


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_types_of(config: Any) -> list[str]:
    """``config.layer_types`` (transformers' Qwen2/Qwen3/Gemma 3 style), all full attention if absent."""
    return list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)


def layer_types_windows(config: Any) -> tuple[int | None, ...]:
    """Per-layer windows from ``config.layer_types``; none if absent."""
    types = layer_types_of(config)
    window = getattr(config, "sliding_window", None)
    return tuple(window if t == "sliding_attention" else None for t in types)


def input_norm(norm: nn.Module, hidden: torch.Tensor, residual: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(``norm`` of ``hidden + residual``, that sum): how a layer reads its input in the decoders' (hidden,
    residual) protocol, where each norm adds the residual in first; the first layer's residual is its input."""
    if residual is None:
        return norm(hidden), hidden
    return norm(hidden, residual)


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding):
        super().__init__()
        self.head_dim = head_dim_of(config)
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.qkv_proj = QKVLinear(config.hidden_size, self.head_dim, heads, kv_heads, bias=spec.qkv_bias)
        self.o_proj = Linear(heads * self.head_dim, config.hidden_size, bias=spec.o_bias)
        # one table shared by every layer of the model; None in a layer without position encoding (SmolLM3)
        self.rotary_emb = rotary if spec.rope_layers is None or spec.rope_layers[layer_index] else None
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops)
        else:
            self.q_norm = self.k_norm = None
        self.attn = Attention(
            heads,
            kv_heads,
            self.head_dim,
            self.head_dim**-0.5 if spec.attention_scale is None else spec.attention_scale,
            ops,
            spec.sliding_windows[layer_index],
            layer_index,
            sinks=spec.attn_sinks,
        )

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        if self.q_norm is not None:
            t = q.shape[0]
            q = self.q_norm(q.reshape(t, -1, self.head_dim)).reshape(t, -1)
            k = self.k_norm(k.reshape(t, -1, self.head_dim)).reshape(t, -1)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta))


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, ops: Any, intermediate_size: int | None = None, bias: bool = False):
        super().__init__()
        inter = intermediate_size or config.intermediate_size  # an MoE expert's own size
        self.gate_up_proj = MergedLinear(config.hidden_size, [inter, inter], ("gate", "up"), bias=bias)
        self.down_proj = Linear(inter, config.hidden_size, bias=bias)
        self.act_fn = get_act_and_mul(getattr(config, "hidden_act", "silu"), ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.gated(x, self.act_fn))


class LlamaDecoderLayer(nn.Module):
    #: The attention's class (Hunyuan normalizes q and k after rotary).
    attention_class: type[nn.Module] = LlamaAttention

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = self.attention_class(config, ops, spec, layer_index, rotary)
        self.mlp = self.make_mlp(config, ops, spec, layer_index)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def make_mlp(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int) -> nn.Module:
        """The layer's MLP (the MoE models' layers build their experts here)."""
        return LlamaMLP(config, ops, bias=spec.mlp_bias)

    def normed_input(self, hidden: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(the input norm of ``hidden + residual``, that sum); the first layer's residual is its input."""
        return input_norm(self.input_layernorm, hidden, residual)

    def forward(self, positions, hidden, residual, meta):
        hidden, residual = self.normed_input(hidden, residual)
        hidden = self.self_attn(hidden, positions, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    #: The decoder layer's class (Granite scales what each layer adds to the residual).
    layer_class: type[nn.Module] = LlamaDecoderLayer
    #: Whether rotary turns only ``partial_rotary_factor`` of each head, as transformers' Phi-3, StableLM,
    #: GPT-NeoX, Phi, GLM and Nemotron do; Llama's and most families' turns whole heads whatever it says
    partial_rotary: bool = False

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec):
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        rotaries = self.make_rotaries(config, ops)
        self.layers = nn.ModuleList(
            self.layer_class(config, ops, spec, i, rotaries[i]) for i in range(config.num_hidden_layers)
        )
        self.norm = self.make_norm(config, ops)

    def make_rotaries(self, config: Any, ops: Any) -> list[RotaryEmbedding]:
        """Each layer's rotary table: one built once that every layer shares (OLMo 3 has one per layer type)."""
        return [get_rope(config, head_dim_of(config), ops, self.partial_rotary)] * config.num_hidden_layers

    def make_norm(self, config: Any, ops: Any) -> nn.Module:
        """The final norm (and models that use LayerNorm build theirs here)."""
        return RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings (models that scale them override this)."""
        return self.embed_tokens(input_ids)

    def embed_inputs(self, input_ids: torch.Tensor, embed_overrides=None) -> torch.Tensor:
        """The first layer's input: token embeddings, with ``embed_overrides`` (rows, values) in place."""
        hidden = self.embed(input_ids)
        if embed_overrides is not None:  # image features replace their placeholder tokens' rows
            rows, values = embed_overrides
            hidden = hidden.index_copy(0, rows, values.to(hidden.dtype))
        return hidden

    def forward(self, input_ids, positions, meta, embed_overrides=None):
        return self.run_layers(self.embed_inputs(input_ids, embed_overrides), positions, meta)

    def run_layers(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The layers and the final norm over the first layer's input ``hidden``."""
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LayerNormModel(LlamaModel):
    """A LlamaModel whose final norm is a LayerNorm of ``layer_norm_eps`` (StableLM, GPT-NeoX, Phi)."""

    def make_norm(self, config: Any, ops: Any) -> nn.Module:
        return LayerNorm(config.hidden_size, config.layer_norm_eps)


class LlamaForCausalLM(nn.Module):
    """``forward(input_ids [T], positions [T], meta) -> hidden [T, H]``; ``compute_logits`` -> float32."""

    #: Whether positions are [3, T] M-RoPE positions (Qwen2-VL) rather than [T].
    uses_mrope = False
    #: The decoder stack, built as ``model_class(config, ops, spec)`` (Gemma 3 has its own).
    model_class: type[nn.Module] = LlamaModel
    #: Whether the LM head has a bias (Phi's)
    lm_head_bias = False
    #: How ``--tensor-parallel-size`` shards the HF weights (distributed/plan.py): module-name suffix ->
    #: column / kv_column / row / vocab; the rest (norms) is replicated. None: the class cannot be sharded.
    tensor_parallel_plan: dict[str, str] | None = {
        "self_attn.q_proj": "column", "self_attn.k_proj": "kv_column", "self_attn.v_proj": "kv_column",
        "self_attn.o_proj": "row", "mlp.gate_proj": "column", "mlp.up_proj": "column", "mlp.down_proj": "row",
        "embed_tokens": "vocab", "lm_head": "vocab",
    }

    def __init__(self, config: Any, ops: Any):
        super().__init__()
        if getattr(config, "num_key_value_heads", None) is None:  # GPT-NeoX, Phi: every head its own k and v
            config.num_key_value_heads = config.num_attention_heads
        self.config = config
        self.ops = ops
        spec = self.decoder_spec(config)
        self.model = self.model_class(config, ops, spec)
        tie = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = LMHead(config.vocab_size, config.hidden_size, self.model.embed_tokens if tie else None,
                              bias=self.lm_head_bias)
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderSpec(qkv_bias=bias, qk_norm=False, sliding_windows=(None,) * config.num_hidden_layers,
                           o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False)))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        embed_overrides: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``embed_overrides`` = (rows [K], values [K, H]): embeddings (e.g. of images) that replace
        the token embeddings of those rows of this step's flat batch."""
        return self.model(input_ids, positions, meta, embed_overrides)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | AffineWeight | HalfWeight]]
                     ) -> QuantizedShards:
        """Load HF-named tensors; raises on unknown names and on parameters left unloaded.

        A tensor may come as an ``AffineWeight`` (a GGUF tensor kept quantized) or a ``HalfWeight`` (a
        16-bit tensor kept so): it is not copied into its dense parameter but returned, by parameter name
        and shard, for ``quant.attach`` to pack (packed at once when its last shard arrives, within
        ``quant.attach.attaching_as_loaded``).
        """
        params = dict(self.named_parameters())
        pending = {name: {None} for name in params}
        quantized: QuantizedShards = {}
        for name, tensor in weights:
            if name.endswith(SKIPPED_SUFFIXES) or (self.lm_head.tied and name == "lm_head.weight"):
                continue
            target, shard = _resolve(name, params)
            module_name, param_name = target.rsplit(".", 1)
            module = self.get_submodule(module_name)
            if isinstance(tensor, (AffineWeight, HalfWeight)):
                quantized.setdefault(target, {})[shard] = tensor
            else:
                with torch.no_grad():
                    if shard is None:
                        _copy_param(params[target], tensor, name)
                    else:
                        module.load_shard(param_name, tensor, shard)
            _mark_loaded(pending, target, shard, module)
            if not pending[target]:
                attach_when_complete(quantized, target)
        missing = sorted(name for name, left in pending.items() if left)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}")
        return quantized


def _resolve(name: str, params: dict[str, nn.Parameter]) -> tuple[str, str | None]:
    for fused, part, shard in STACKED_PARAMS:
        if part in name:
            target = name.replace(part, fused)
            if target in params:
                return target, shard
    if name in params:
        return name, None
    raise ValueError(f"unexpected tensor {name!r} in checkpoint")


def _mark_loaded(pending: dict[str, set], target: str, shard: str | None, module: nn.Module) -> None:
    left = pending[target]
    if left == {None} and shard is not None:
        left.clear()
        left.update(module.shard_names)
    left.discard(shard)


def _copy_param(param: nn.Parameter, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(
            f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)}, model {tuple(param.shape)}"
        )
    param.data.copy_(tensor)
