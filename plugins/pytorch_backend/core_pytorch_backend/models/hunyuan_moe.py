"""Hunyuan MoE (Tencent's HunYuanMoEV1: Hunyuan-A13B): Hunyuan dense's layers (models/hunyuan_dense.py: q and k
RMS-normalized head by head after rotary, the fixed NTK ``alpha``) whose every MLP is a sparse mixture of
``num_experts`` experts of ``intermediate_size`` (models/sparse_moe.py), each token through its ``moe_topk`` best
(one number, or one a layer), their softmax probabilities renormalized, plus a shared SwiGLU of
``intermediate_size`` (``shared_mlp``) every token runs through, ungated; as transformers builds it, whatever the
original checkpoints' other MoE fields say. Those that would change the layers (cross-layer attention
``use_cla``, no shared MLP, no q/k norms, other shared or expert sizes, skipped MoE layers) are refused. Checkpoint
names: ``mlp.gate.wg`` (the router), ``mlp.experts.{e}.*``, ``mlp.shared_mlp.*``."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from torch import nn

from ..quant.attach import QuantizedShards
from .hunyuan_dense import HunYuanDenseV1DecoderLayer, HunYuanDenseV1ForCausalLM
from .llama import DecoderSpec, LlamaModel
from .names import parts_renamed
from .sparse_moe import SparseMoeBlock

RENAMED = ((".mlp.gate.wg.", ".mlp.gate."), (".mlp.shared_mlp.", ".mlp.shared_expert."))


def moe_block(config: Any, ops: Any, layer_index: int) -> SparseMoeBlock:
    """Layer ``layer_index``'s experts and shared MLP."""
    top_k = config.moe_topk if isinstance(config.moe_topk, int) else config.moe_topk[layer_index]
    return SparseMoeBlock(config, ops, config.num_experts, top_k, config.intermediate_size, normalize=True,
                          shared_size=config.intermediate_size, shared_gate=False)


class HunYuanMoEV1DecoderLayer(HunYuanDenseV1DecoderLayer):
    def make_mlp(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int) -> nn.Module:
        return moe_block(config, ops, layer_index)


class HunYuanMoEV1Model(LlamaModel):
    layer_class = HunYuanMoEV1DecoderLayer


class HunYuanMoEV1ForCausalLM(HunYuanDenseV1ForCausalLM):
    model_class = HunYuanMoEV1Model
    #: experts are not split across ranks
    tensor_parallel_plan = None

    def __init__(self, config: Any, ops: Any):
        refuse_unsupported(config)
        super().__init__(config, ops)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        return super().load_weights(_our_names(weights))


def refuse_unsupported(config: Any) -> None:
    """NotImplementedError naming the first field of the original Hunyuan configs set to what is not served."""
    size = config.intermediate_size
    unsupported = {
        "use_cla": lambda v: bool(v),  # cross-layer attention: layers sharing another layer's K/V
        "use_mixed_mlp_moe": lambda v: v is not None and not v,
        "use_qk_norm": lambda v: v is not None and not v,
        "num_shared_expert": lambda v: v is not None and any(n != 1 for n in _per_layer(v)),
        "moe_intermediate_size": lambda v: v is not None and any(n != size for n in _per_layer(v)),
        "moe_layer_num_skipped": lambda v: bool(v),
    }
    for field, refused in unsupported.items():
        value = getattr(config, field, None)
        if refused(value):
            raise NotImplementedError(f"HunYuanMoEV1: {field}={value!r} is not supported (served as transformers "
                                      f"builds the model: a shared MLP and experts of intermediate_size={size}, "
                                      "q/k norms, every layer its own attention)")


def _per_layer(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _our_names(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    for name, tensor in weights:
        yield parts_renamed(name, RENAMED), tensor
