"""GPT-Neo (``GPTNeoForCausalLM``: EleutherAI/gpt-neo-125m, 1.3B, 2.7B): GPT-2's layout (``models.gpt2``:
learned absolute positions ``wpe``, pre-norm LayerNorm layers, an ungated MLP ``c_fc`` / ``c_proj`` with
biases, the LM head tied to ``wte``), its weights ``nn.Linear``'s (nothing transposed), and an attention of
its own: q/k/v projections without biases (kept merged as Llama's ``qkv_proj``), ``out_proj`` with one, the
scores not scaled at all (no 1 / sqrt(head_dim)), and the layers taking turns, as ``attention_types`` lists
them, between global attention and local attention over the last ``window_size`` positions (the query's own
and the window_size - 1 before it). Following transformers' ``modeling_gpt_neo``."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from torch import nn

from ..layers import LayerNorm, VocabEmbedding
from ..quant.attach import QuantizedShards
from .gpt2 import RENAMED, GPT2Block, GPT2Model
from .llama import DecoderSpec, LlamaAttention, LlamaForCausalLM
from .names import parts_renamed, prefix_renamed
from .ungated_mlp import UngatedMLP

IN_LAYER = ((".attn.attention.out_proj.", ".attn.o_proj."), (".attn.attention.", ".attn."))
#: buffers of older checkpoints (each layer's causal or local mask, its fill value) that are not weights
SKIPPED = (".attn.attention.bias", ".attn.attention.masked_bias")


def layer_windows(config: Any) -> tuple[int | None, ...]:
    """Each layer's window: ``window_size`` on the local layers, none on the global ones."""
    unknown = set(config.attention_layers) - {"global", "local"}
    if unknown:
        raise NotImplementedError(f"GPT-Neo: attention_types names {sorted(unknown)}; only 'global' and "
                                  "'local' layers exist")
    return tuple(config.window_size if kind == "local" else None for kind in config.attention_layers)


class GPTNeoBlock(GPT2Block):
    """GPT-2's block (its forward) with GPT-Neo's attention and MLP size."""

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int):
        nn.Module.__init__(self)  # not GPT2Block's: its attention is GPT-2's
        eps, hidden = config.layer_norm_epsilon, config.hidden_size
        self.ln_1 = LayerNorm(hidden, eps)
        self.attn = LlamaAttention(config, ops, spec, layer_index, None)
        self.ln_2 = LayerNorm(hidden, eps)
        inner = config.intermediate_size or 4 * hidden
        self.mlp = UngatedMLP(hidden, inner, config.activation_function, ("c_fc", "c_proj"))


class GPTNeoModel(GPT2Model):
    """GPT-2's decoder (its forward: token and position embeddings, the blocks, ``ln_f``) of GPT-Neo's
    blocks."""

    def __init__(self, config: Any, ops: Any, spec: DecoderSpec):
        nn.Module.__init__(self)  # not GPT2Model's: its blocks are GPT-2's
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.embed_positions = VocabEmbedding(config.max_position_embeddings, config.hidden_size)
        layers = range(config.num_hidden_layers)
        self.layers = nn.ModuleList(GPTNeoBlock(config, ops, spec, i) for i in layers)
        self.norm = LayerNorm(config.hidden_size, config.layer_norm_epsilon)


class GPTNeoForCausalLM(LlamaForCausalLM):
    model_class = GPTNeoModel
    tensor_parallel_plan = None  # its MLP is named c_fc / c_proj, which the Llama plan does not shard

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        return DecoderSpec(qkv_bias=False, qk_norm=False, sliding_windows=layer_windows(config), o_bias=True,
                           attention_scale=1.0)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        return super().load_weights(_ours(weights))


def _ours(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    for name, tensor in weights:
        if name.endswith(SKIPPED):
            continue
        yield parts_renamed(prefix_renamed(name, RENAMED), IN_LAYER), tensor

