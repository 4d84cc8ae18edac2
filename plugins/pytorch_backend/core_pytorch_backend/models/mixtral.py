"""Mixtral: Mistral whose every MLP is a sparse mixture of ``num_local_experts`` experts of
``intermediate_size`` (models/sparse_moe.py), each token through its ``num_experts_per_tok`` best, their
probabilities always renormalized. Its checkpoints name the block ``block_sparse_moe`` and each expert's
projections ``w1`` (gate), ``w3`` (up) and ``w2`` (down): read under the names the other models use."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from ..quant.attach import QuantizedShards
from .llama import DecoderSpec, LlamaDecoderLayer, LlamaModel
from .mistral import MistralForCausalLM
from .names import parts_renamed
from .sparse_moe import SparseMoeBlock

RENAMED = ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."), (".w2.", ".down_proj."))


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int) -> nn.Module:
        return SparseMoeBlock(config, ops, config.num_local_experts, config.num_experts_per_tok,
                              config.intermediate_size, normalize=True)


class MixtralModel(LlamaModel):
    layer_class = MixtralDecoderLayer


class MixtralForCausalLM(MistralForCausalLM):
    model_class = MixtralModel
    #: experts are not split across ranks
    tensor_parallel_plan = None

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        return super().load_weights((_our_name(name), tensor) for name, tensor in weights)


def _our_name(name: str) -> str:
    return parts_renamed(name, RENAMED) if ".block_sparse_moe." in name else name
