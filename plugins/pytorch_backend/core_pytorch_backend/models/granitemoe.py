"""Granite MoE (IBM Granite 3.x 1B-A400M, 3B-A800M) and Granite MoE Shared: Granite's multipliers
(models/granite.py) with every MLP a sparse mixture of ``num_local_experts`` experts of ``intermediate_size``
(models/sparse_moe.py), each token through its ``num_experts_per_tok`` best router logits, weighted by the
softmax of those alone; the Shared variant adds an ungated SwiGLU of ``shared_intermediate_size`` every token
runs through. Checkpoints keep a layer's experts as two stacked tensors (``block_sparse_moe.input_linear``
[experts, 2 x size, hidden], gate above up; ``output_linear`` [experts, hidden, size]) and the router as
``block_sparse_moe.router.layer``: read one expert at a time under the names the other MoE models use."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ..quant.attach import QuantizedShards
from .granite import GraniteDecoderLayer, GraniteForCausalLM, GraniteModel
from .llama import DecoderSpec
from .sparse_moe import SparseMoeBlock


class GraniteMoeDecoderLayer(GraniteDecoderLayer):
    def make_mlp(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int) -> nn.Module:
        return SparseMoeBlock(config, ops, config.num_local_experts, config.num_experts_per_tok,
                              config.intermediate_size, normalize=False, softmax_of_top_k=True,
                              shared_size=getattr(config, "shared_intermediate_size", None) or None, shared_gate=False)


class GraniteMoeModel(GraniteModel):
    layer_class = GraniteMoeDecoderLayer


class GraniteMoeForCausalLM(GraniteForCausalLM):
    model_class = GraniteMoeModel
    #: experts are not split across ranks
    tensor_parallel_plan = None

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        return super().load_weights(experts_one_by_one(weights))


def experts_one_by_one(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Granite MoE's stacked expert tensors as one tensor per expert and projection, under the names of
    ``SparseMoeBlock`` (``mlp.gate``, ``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``,
    ``mlp.shared_expert.*``); other tensors as they are."""
    for name, tensor in weights:
        if ".block_sparse_moe." not in name and ".shared_mlp." not in name:
            yield name, tensor
            continue
        if not isinstance(tensor, torch.Tensor):
            raise NotImplementedError(f"{name}: Granite MoE's stacked experts from a quantized file")
        layer = name.split(".block_sparse_moe.")[0] if ".block_sparse_moe." in name else name.split(".shared_mlp.")[0]
        if name.endswith("router.layer.weight"):
            yield f"{layer}.mlp.gate.weight", tensor
        elif ".shared_mlp." in name:
            yield from _projections(f"{layer}.mlp.shared_expert", name, tensor)
        else:
            for expert in range(tensor.shape[0]):
                yield from _projections(f"{layer}.mlp.experts.{expert}", name, tensor[expert])


def _projections(prefix: str, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """An ``input_linear`` (gate rows above up rows) or ``output_linear`` (down) weight under ``prefix``."""
    if name.endswith("input_linear.weight"):
        gate, up = tensor.chunk(2, dim=0)
        yield f"{prefix}.gate_proj.weight", gate
        yield f"{prefix}.up_proj.weight", up
    elif name.endswith("output_linear.weight"):
        yield f"{prefix}.down_proj.weight", tensor
    else:
        raise ValueError(f"unexpected tensor {name!r} in checkpoint")
