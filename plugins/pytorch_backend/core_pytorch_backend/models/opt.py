"""OPT (``OPTForCausalLM``: facebook/opt-125m to 66b): learned absolute positions (``embed_positions``, offset
by 2), pre-norm layers with LayerNorms, q/k/v/out projections with biases (``enable_bias``), q scaled by
``head_dim ** -0.5`` after its projection (attention unscaled, as transformers orders it), an ungated ReLU MLP
(``fc1`` / ``fc2`` on the layer itself) and no rotary. The post-norm layout (``do_layer_norm_before`` false:
opt-350m) and the projected embeddings (``word_embed_proj_dim``) are refused at load. Following
transformers' ``modeling_opt``; the checkpoints' ``model.decoder.`` names are read as this model's."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import Activation, Attention, LayerNorm, Linear, QKVLinear, VocabEmbedding
from ..quant.attach import QuantizedShards
from .llama import DecoderSpec, LlamaForCausalLM, LlamaModel, input_norm
from .names import parts_renamed

POSITION_OFFSET = 2  # OPT's position table starts two rows in (fairseq's padding convention)
EPS = 1e-5  # torch's LayerNorm default, which OPT keeps


def check_supported(config: Any) -> None:
    if not getattr(config, "do_layer_norm_before", True):
        raise NotImplementedError("OPT: do_layer_norm_before false (post-norm layers, opt-350m) is not supported")
    if getattr(config, "word_embed_proj_dim", config.hidden_size) != config.hidden_size:
        raise NotImplementedError("OPT: word_embed_proj_dim other than hidden_size (project_in / project_out) "
                                  "is not supported")
    if getattr(config, "_remove_final_layer_norm", False) or not getattr(config, "layer_norm_elementwise_affine", True):
        raise NotImplementedError("OPT: a model without its final LayerNorm or its norms' weights is not supported")


def biased(config: Any) -> bool:
    """Whether the projections have biases (``enable_bias``; XGLM's always do)."""
    return bool(getattr(config, "enable_bias", True))


class OPTAttention(nn.Module):
    #: Whether q is scaled after its projection and the scores not (OPT's order; BioGPT scales the scores)
    scales_queries = True

    def __init__(self, config: Any, ops: Any, layer_index: int):
        super().__init__()
        hidden, heads, bias = config.hidden_size, config.num_attention_heads, biased(config)
        self.head_dim = hidden // heads
        scale = self.head_dim ** -0.5
        self.scaling = scale if self.scales_queries else 1.0
        self.qkv_proj = QKVLinear(hidden, self.head_dim, heads, heads, bias=bias)
        self.out_proj = Linear(hidden, hidden, bias=bias)
        self.attn = Attention(heads, heads, self.head_dim, 1.0 if self.scales_queries else scale, ops, None,
                              layer_index)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))
        return self.out_proj(self.attn(q * self.scaling, k, v, meta))


class OPTDecoderLayer(nn.Module):
    attention_class: type[nn.Module] = OPTAttention

    def __init__(self, config: Any, ops: Any, layer_index: int):
        super().__init__()
        bias = biased(config)
        self.self_attn = self.attention_class(config, ops, layer_index)
        self.self_attn_layer_norm = LayerNorm(config.hidden_size, EPS)
        width = getattr(config, "ffn_dim", None) or config.intermediate_size  # BioGPT's name
        self.fc1 = Linear(config.hidden_size, width, bias=bias)
        self.fc2 = Linear(width, config.hidden_size, bias=bias)
        self.act = Activation(getattr(config, "activation_function", None) or config.hidden_act)
        self.final_layer_norm = LayerNorm(config.hidden_size, EPS)

    def forward(self, positions, hidden, residual, meta):
        """In the Llama layers' (hidden, residual) protocol: the next norm adds the two."""
        normed, residual = input_norm(self.self_attn_layer_norm, hidden, residual)
        normed, residual = self.final_layer_norm(self.self_attn(normed, positions, meta), residual)
        return self.fc2(self.act(self.fc1(normed))), residual


class OPTModel(LlamaModel):
    layer_class = OPTDecoderLayer

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec):
        nn.Module.__init__(self)  # not LlamaModel's: no rotary, positions of its own
        check_supported(config)
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.embed_positions = self.make_positions(config)
        self.layers = nn.ModuleList(self.layer_class(config, ops, i) for i in range(config.num_hidden_layers))
        self.norm = LayerNorm(config.hidden_size, EPS)

    def make_positions(self, config: Any) -> nn.Module:
        """The table of position embeddings, read at position + 2: OPT's learned one (XGLM's sinusoids)."""
        return VocabEmbedding(config.max_position_embeddings + POSITION_OFFSET, config.hidden_size)

    def forward(self, input_ids, positions, meta, embed_overrides=None):
        hidden = self.embed_inputs(input_ids, embed_overrides) + self.embed_positions(positions + POSITION_OFFSET)
        return self.run_layers(hidden, positions, meta)


class ScaledEmbeddingOPTModel(OPTModel):
    """OPT's decoder with its token embeddings times ``sqrt(hidden_size)`` where ``scale_embedding`` (XGLM, BioGPT)."""

    def __init__(self, config: Any, *args: Any) -> None:
        super().__init__(config, *args)
        self.embed_scale = math.sqrt(config.hidden_size) if config.scale_embedding else 1.0

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale


class OPTForCausalLM(LlamaForCausalLM):
    model_class = OPTModel
    tensor_parallel_plan = None  # its projections are named out_proj / fc1 / fc2, which the Llama plan does not shard
    #: (theirs, ours) parts of checkpoint names read before OPT's own (XGLM's and BioGPT's)
    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        bias = biased(config)
        return DecoderSpec(qkv_bias=bias, qk_norm=False, sliding_windows=(None,) * config.num_hidden_layers,
                           o_bias=bias)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        renamed = ((parts_renamed(name, self.checkpoint_renames), tensor) for name, tensor in weights)
        return super().load_weights((_our_name(name), tensor) for name, tensor in renamed)


def _our_name(name: str) -> str:
    name = name.replace("model.decoder.", "model.", 1)
    return name.replace("model.final_layer_norm.", "model.norm.", 1)
