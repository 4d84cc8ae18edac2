"""Zamba2 (``Zamba2ForCausalLM``: Zyphra's Zamba2-1.2B / 2.7B / 7B): a stack of Mamba-2 layers (models/mamba2_mixer.py:
``n_mamba_heads`` heads of ``mamba_expand * hidden_size / n_mamba_heads``, the gated norm at eps 1e-5, a biased
convolution, dt clamped from ``time_step_min`` in the chunked form), each ``h + mamba(norm(h))``, where the layers
``layers_block_type`` names "hybrid" first run a transformer block shared among them: ``num_mem_blocks`` blocks,
hybrid layer j running block ``j % num_mem_blocks`` (where the config ties weights: transformers ties the blocks
only under ``tie_word_embeddings``, and gives each hybrid layer a block of its own otherwise). A block reads
``[h, the token embeddings]`` (2 x hidden wide) through an RMSNorm, attention of ``num_attention_heads`` heads of ``2 x hidden / num_attention_heads`` (q/k/v from the
doubled width, the softmax scale ``(head_dim / 2) ** -0.5``, rotary only where ``use_mem_rope``), an RMSNorm and a
gated MLP of ``hidden_act`` on a fused ``gate_up_proj``; each hybrid layer adds its own low-rank adapters to the
block's gate/up projection (and to q, k and v where ``use_shared_attention_adapter``), keeps its own KV cache, and
projects the block's output by its ``linear`` into the input of its Mamba layer's norm (``h + mamba(norm(h + t))``).
Following transformers' ``modeling_zamba2``.

The shared blocks' weights are read under the first hybrid layer of each block (transformers' checkpoints hold them
there alone; a copy under a later hybrid layer is read into the same weights)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..layers import Attention, Linear, RMSNorm, RotaryEmbedding, VocabEmbedding, get_act_and_mul, get_rope
from ..quant.attach import QuantizedShards
from .llama import DecoderSpec, LlamaForCausalLM, LlamaModel, head_dim_of
from .mamba2_mixer import Mamba2Mixer, MixerSpec, time_step_limit_of
from .names import prefix_renamed

MIXER_NORM_EPS = 1e-5  # Zamba2RMSNormGated's, as transformers builds it
RENAMED = (("model.final_layernorm.", "model.norm."),)
_SHARED = re.compile(r"^model\.layers\.(\d+)\.shared_transformer\.")


def mixer_spec(config: Any) -> MixerSpec:
    return MixerSpec(hidden_size=config.hidden_size, heads=config.n_mamba_heads, head_dim=config.mamba_headdim,
                     state_size=config.mamba_d_state, groups=config.mamba_ngroups, conv_kernel=config.mamba_d_conv,
                     chunk_size=config.chunk_size, norm_eps=MIXER_NORM_EPS, in_bias=bool(config.add_bias_linear),
                     out_bias=bool(config.add_bias_linear),
                     time_step_limit=time_step_limit_of((config.time_step_min, math.inf)))


def adapters(width_in: int, width_out: int, rank: int, owned: list[bool]) -> nn.ModuleList:
    """Each hybrid layer's low-rank adapter (``in -> rank -> out``) where the block owns it, else an Identity
    (never run: a hybrid layer runs the block that owns its adapter), as transformers lists them."""
    return nn.ModuleList(nn.Sequential(Linear(width_in, rank), Linear(rank, width_out)) if mine else nn.Identity()
                         for mine in owned)


class SharedAttention(nn.Module):
    """The shared block's q/k/v/o projections (and adapters); the attention itself (and its KV cache) is the
    hybrid layer's."""

    def __init__(self, config: Any, owned: list[bool]):
        super().__init__()
        width, head_dim = config.attention_hidden_size, config.attention_head_dim
        self.q_proj = Linear(width, config.num_attention_heads * head_dim)
        self.k_proj = Linear(width, config.num_key_value_heads * head_dim)
        self.v_proj = Linear(width, config.num_key_value_heads * head_dim)
        self.o_proj = Linear(config.num_attention_heads * head_dim, config.hidden_size)
        self.adapted = bool(config.use_shared_attention_adapter)
        if self.adapted:
            rank = config.adapter_rank
            self.linear_q_adapter_list = adapters(width, width, rank, owned)
            self.linear_k_adapter_list = adapters(width, width, rank, owned)
            self.linear_v_adapter_list = adapters(width, width, rank, owned)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, attn: Attention,
                rotary: RotaryEmbedding | None, hybrid: int) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.adapted:
            q = q + self.linear_q_adapter_list[hybrid](x)
            k = k + self.linear_k_adapter_list[hybrid](x)
            v = v + self.linear_v_adapter_list[hybrid](x)
        if rotary is not None:
            q, k = rotary(positions, q, k)
        return self.o_proj(attn(q, k, v, meta))


class SharedMLP(nn.Module):
    def __init__(self, config: Any, ops: Any, owned: list[bool]):
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, bool(config.add_bias_linear)
        self.gate_up_proj = Linear(hidden, 2 * inter, bias=bias)
        self.down_proj = Linear(inter, hidden, bias=bias)
        self.gate_up_proj_adapter_list = adapters(hidden, 2 * inter, config.adapter_rank, owned)
        self.act_fn = get_act_and_mul(config.hidden_act, ops)

    def forward(self, x: torch.Tensor, hybrid: int) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x) + self.gate_up_proj_adapter_list[hybrid](x)))


class SharedTransformer(nn.Module):
    """One of the ``num_mem_blocks`` shared blocks (``block``), with the adapters of the hybrid layers it runs."""

    def __init__(self, config: Any, ops: Any, block: int, hybrid_layers: int):
        super().__init__()
        owned = [j % config.num_mem_blocks == block for j in range(hybrid_layers)]
        self.input_layernorm = RMSNorm(config.attention_hidden_size, config.rms_norm_eps, ops)
        self.self_attn = SharedAttention(config, owned)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.feed_forward = SharedMLP(config, ops, owned)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                attn: Attention, rotary: RotaryEmbedding | None, hybrid: int) -> torch.Tensor:
        x = self.input_layernorm(torch.cat([hidden, embedded], dim=-1))
        attended = self.self_attn(x, positions, meta, attn, rotary, hybrid)
        return self.feed_forward(self.pre_ff_layernorm(attended), hybrid)


class Zamba2MambaLayer(nn.Module):
    """``h + mamba(norm(h + t))``, ``t`` a hybrid layer's block output (none in a plain Mamba layer)."""

    def __init__(self, config: Any, ops: Any):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.mamba = Mamba2Mixer(mixer_spec(config))

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata,
                added: torch.Tensor | None = None) -> torch.Tensor:
        return hidden + self.mamba(self.input_layernorm(hidden if added is None else hidden + added), meta)


class Zamba2HybridLayer(nn.Module):
    def __init__(self, config: Any, ops: Any, shared: SharedTransformer, hybrid: int, layer_index: int,
                 rotary: RotaryEmbedding | None):
        super().__init__()
        self.shared_transformer = shared  # the same module in every hybrid layer of its block
        self.hybrid, self.rotary = hybrid, rotary
        head_dim = config.attention_head_dim
        self.attn = Attention(config.num_attention_heads, config.num_key_value_heads, head_dim, (head_dim / 2) ** -0.5,
                              ops, None, layer_index)
        self.linear = Linear(config.hidden_size, config.hidden_size)
        self.mamba_decoder = Zamba2MambaLayer(config, ops)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        block = self.shared_transformer(hidden, embedded, positions, meta, self.attn, self.rotary, self.hybrid)
        return self.mamba_decoder(hidden, meta, self.linear(block))


class Zamba2Model(LlamaModel):
    def __init__(self, config: Any, ops: Any, spec: DecoderSpec):
        nn.Module.__init__(self)  # Llama's builds one kind of layer
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        hybrid = list(config.hybrid_layer_ids)
        rotary = get_rope(config, head_dim_of(config), ops) if config.use_mem_rope else None
        count = block_count(config)
        blocks = [SharedTransformer(config, ops, b % config.num_mem_blocks, len(hybrid)) for b in range(count)]
        self.layers = nn.ModuleList(
            Zamba2HybridLayer(config, ops, blocks[hybrid.index(i) % count], hybrid.index(i), i, rotary)
            if i in hybrid else Zamba2MambaLayer(config, ops) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def run_layers(self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        embedded = hidden
        for layer in self.layers:
            if isinstance(layer, Zamba2HybridLayer):
                hidden = layer(hidden, embedded, positions, meta)
            else:
                hidden = layer(hidden, meta)
        return self.norm(hidden)


class Zamba2ForCausalLM(LlamaForCausalLM):
    model_class = Zamba2Model
    tensor_parallel_plan = None

    def __init__(self, config: Any, ops: Any) -> None:
        if config.use_shared_attention_adapter and config.num_key_value_heads != config.num_attention_heads:
            raise NotImplementedError(  # the k/v adapters are as wide as q: transformers fails at the first step
                f"Zamba2: use_shared_attention_adapter with num_key_value_heads {config.num_key_value_heads} "
                f"!= num_attention_heads {config.num_attention_heads} is not supported")
        super().__init__(config, ops)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        return super().load_weights(_our_names(weights, self.config))


def block_count(config: Any) -> int:
    """How many transformer blocks the hybrid layers run: ``num_mem_blocks`` shared ones where the config ties
    weights (``tie_word_embeddings``: transformers ties the blocks only then), else one each."""
    hybrid = len(config.hybrid_layer_ids)
    return min(config.num_mem_blocks, hybrid) if config.tie_word_embeddings else hybrid


def _our_names(weights: Iterable[tuple[str, Any]], config: Any) -> Iterator[tuple[str, Any]]:
    """The final norm as ``model.norm``; a shared block's tensors under the first hybrid layer that runs it."""
    hybrid = list(config.hybrid_layer_ids)
    blocks = block_count(config)
    for name, tensor in weights:
        shared = _SHARED.match(name)
        if shared is not None:
            first = hybrid[hybrid.index(int(shared.group(1))) % blocks]
            name = f"model.layers.{first}.shared_transformer." + name[shared.end():]
        yield prefix_renamed(name, RENAMED), tensor
