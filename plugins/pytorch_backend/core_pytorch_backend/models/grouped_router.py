"""The mixture of experts DeepSeek-V2/V3, GLM-4.5 (``Glm4MoeForCausalLM``), GLM-4.7-Flash
(``Glm4MoeLiteForCausalLM``), dots.llm1 (``Dots1ForCausalLM``), EXAONE MoE (``ExaoneMoeForCausalLM``) and AFMoE
(``AfmoeForCausalLM``; the last two name their counts ``num_experts`` and ``num_shared_experts``) share: from layer
``first_k_dense_replace`` on (or where ``mlp_layer_types`` says "sparse"), every MLP is ``n_routed_experts`` SwiGLU
experts of ``moe_intermediate_size`` plus one shared MLP of ``n_shared_experts * moe_intermediate_size`` every token
runs through (ungated), each token through ``num_experts_per_tok`` experts chosen within its best ``topk_group`` of
``n_group`` expert groups; the layers before are dense MLPs of ``intermediate_size``. Two routing rules, as
transformers' routers compute them (``DeepseekV2TopkRouter``, ``DeepseekV3TopkRouter``):

- DeepSeek-V2's ``greedy`` / ``group_limited_greedy``: softmax scores; a group ranks by its best score; the
  weights are the chosen scores times ``routed_scaling_factor``, never renormalized.
- ``noaux_tc`` (DeepSeek-V3, Kimi K2, Moonlight, GLM-4.5 / 4.7-Flash, dots.llm1, EXAONE MoE, AFMoE): sigmoid
  scores; the choice (of groups, each ranked by the sum of its best two, and of experts) is made on the scores
  plus the router's ``e_score_correction_bias``, the weights are the chosen scores without it, divided by their
  sum (+ 1e-20) where ``norm_topk_prob``, then times ``routed_scaling_factor``.

The experts are models/sparse_moe.py's (its expert loop, each a ``LlamaMLP``); the router stays float32 in a
bfloat16 model, as transformers keeps it. Checkpoint names ``mlp.gate.weight``, ``mlp.gate.e_score_correction_bias``,
``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` (what the released checkpoints hold and transformers 5
saves) or the fused ``mlp.experts.gate_up_proj`` [experts, 2 x size, hidden] / ``mlp.experts.down_proj``
[experts, hidden, size] of transformers' modules, and ``mlp.shared_experts.*``. The multi-token-prediction layers
some checkpoints append (``num_nextn_predict_layers``: ``model.layers.{num_hidden_layers}.*``) are skipped, as
transformers skips them."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..quant.attach import QuantizedShards
from ..quant.fp8_blocks import fp8_block_size
from .llama import DecoderSpec, LlamaDecoderLayer, LlamaModel
from .sparse_moe import SparseMoeBlock

#: added to the chosen weights' sum before dividing by it, as transformers does
NORM_EPSILON = 1e-20
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class ExpertCounts:
    """How many routed experts a sparse layer has and how many experts' widths its shared MLP is: DeepSeek's
    ``n_routed_experts`` / ``n_shared_experts``, or EXAONE MoE's and AFMoE's ``num_experts`` /
    ``num_shared_experts``."""

    routed: int
    shared: int

    @classmethod
    def of(cls, config: Any) -> ExpertCounts:
        if hasattr(config, "n_routed_experts"):
            return cls(config.n_routed_experts, config.n_shared_experts or 0)
        return cls(config.num_experts, config.num_shared_experts or 0)


def is_dense_layer(config: Any, index: int) -> bool:
    """Whether layer ``index`` has a dense MLP: as ``mlp_layer_types`` says where the config lists it (GLM-4.7-Flash,
    EXAONE MoE), else the first ``first_k_dense_replace`` layers."""
    types = getattr(config, "mlp_layer_types", None)
    return types[index] == "dense" if types else index < (config.first_k_dense_replace or 0)


@dataclass(frozen=True)
class GroupedRouting:
    """How a token's experts and their weights follow from its router logits (module docstring)."""

    top_k: int
    groups: int  # n_group (1: no group limit)
    kept_groups: int  # topk_group
    noaux_tc: bool  # sigmoid scores, a correction bias for the choice, groups ranked by their best two
    normalize: bool  # norm_topk_prob
    scaling: float  # routed_scaling_factor

    @classmethod
    def of(cls, config: Any, noaux_tc: bool, normalize: bool, grouped: bool = True) -> GroupedRouting:
        """The rule a config's fields give; without ``grouped`` (or ``n_group`` unset) no group limit."""
        groups, kept = (config.n_group or 1, config.topk_group or 1) if grouped else (1, 1)
        rule = cls(config.num_experts_per_tok, groups, kept, noaux_tc, normalize, float(config.routed_scaling_factor))
        rule.check(ExpertCounts.of(config).routed)
        return rule

    def check(self, experts: int) -> None:
        if experts % self.groups:
            raise ValueError(f"n_group {self.groups} does not divide n_routed_experts {experts}")
        if self.noaux_tc and self.groups > 1 and experts // self.groups < 2:
            raise ValueError(f"n_group {self.groups} of n_routed_experts {experts}: groups of one expert, but "
                             "noaux_tc ranks each group by the sum of its best two")
        if self.kept_groups > self.groups or self.top_k > self.kept_groups * (experts // self.groups):
            raise ValueError(f"num_experts_per_tok {self.top_k} experts cannot come from topk_group "
                             f"{self.kept_groups} of n_group {self.groups} groups of {experts // self.groups}")

    def route(self, logits: torch.Tensor, correction_bias: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, top_k] float32, experts [T, top_k]) of float32 router logits [T, experts]."""
        scores = logits.sigmoid() if self.noaux_tc else logits.softmax(dim=-1)
        choice = scores if correction_bias is None else scores + correction_bias
        if self.groups > 1:
            choice = self.within_best_groups(choice)
        chosen = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, chosen)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + NORM_EPSILON)
        return weights * self.scaling, chosen

    def within_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """``choice`` with the experts outside each token's best ``kept_groups`` groups at -inf."""
        grouped = choice.view(choice.shape[0], self.groups, -1)
        rank = grouped.topk(2, dim=-1)[0].sum(dim=-1) if self.noaux_tc else grouped.max(dim=-1).values
        best = torch.topk(rank, self.kept_groups, dim=-1, sorted=False)[1]
        kept = torch.zeros_like(rank, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~kept[..., None], float("-inf")).view_as(choice)


def noaux_tc_routing(config: Any) -> GroupedRouting:
    """DeepSeek-V3's rule (``DeepseekV3TopkRouter``: GLM-4.5's and dots.llm1's too)."""
    return GroupedRouting.of(config, noaux_tc=True, normalize=bool(config.norm_topk_prob))


class GroupedMoeBlock(SparseMoeBlock):
    """``SparseMoeBlock`` routed by a ``GroupedRouting``, with the shared MLP ungated; under ``noaux_tc`` the
    router holds ``e_score_correction_bias`` (checkpoint name ``mlp.gate.e_score_correction_bias``)."""

    def __init__(self, config: Any, ops: Any, rule: GroupedRouting) -> None:
        counts = ExpertCounts.of(config)
        shared = counts.shared * config.moe_intermediate_size
        super().__init__(config, ops, counts.routed, rule.top_k, config.moe_intermediate_size,
                         rule.normalize, shared_size=shared or None, shared_gate=False)
        self.rule = rule
        if rule.noaux_tc:
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(counts.routed), requires_grad=False)

    def _apply(self, fn, recurse=True):
        """Whatever dtype the model takes, the router (``gate.weight``, ``e_score_correction_bias``) stays float32,
        as transformers keeps it (``_keep_in_fp32_modules_strict``): the bias shifts the scores it ranks by
        amounts bfloat16 would round."""
        super()._apply(fn, recurse)
        for param in self.gate.parameters():
            param.data = param.data.float()
        return self

    def routing(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = nn.functional.linear(hidden.float(), self.gate.weight)
        bias = self.gate.e_score_correction_bias if self.rule.noaux_tc else None
        weights, chosen = self.rule.route(logits, bias)
        return weights.to(hidden.dtype), chosen


class GroupedMoeDecoderLayer(LlamaDecoderLayer):
    """Llama's layer whose MLP is a ``GroupedMoeBlock`` where ``is_dense_layer`` says not (``noaux_tc`` routing;
    DeepSeek-V2's layer overrides ``routing_rule``)."""

    def make_mlp(self, config: Any, ops: Any, spec: DecoderSpec, layer_index: int) -> nn.Module:
        if is_dense_layer(config, layer_index):
            return super().make_mlp(config, ops, spec, layer_index)
        return GroupedMoeBlock(config, ops, self.routing_rule(config))

    def routing_rule(self, config: Any) -> GroupedRouting:
        return noaux_tc_routing(config)


class GroupedMoeModel(LlamaModel):
    layer_class = GroupedMoeDecoderLayer


class GroupedMoeCheckpoint:
    """Mixin (first among the bases) for these models' CausalLM classes: refuses quantized checkpoints at
    construction and reads their checkpoint names (module docstring) as the Llama loader's."""

    def __init__(self, config: Any, ops: Any) -> None:
        self.check_config(config)
        super().__init__(config, ops)

    @classmethod
    def check_config(cls, config: Any) -> None:
        """Raises NotImplementedError naming a config field this implementation does not serve."""
        cls.check_quantization(config)

    @classmethod
    def check_quantization(cls, config: Any) -> None:
        quantization = getattr(config, "quantization_config", None)
        if quantization and fp8_block_size(config) is None:  # FP8 blocks: dequantized by the loader
            method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
            raise NotImplementedError(f"{cls.__name__}: quantization_config (quant_method {method!r}) is not "
                                      "supported; serve a bfloat16 / float32 checkpoint")

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        return super().load_weights(grouped_moe_names(weights, self.config))  # type: ignore[misc]


def grouped_moe_names(weights: Iterable[tuple[str, Any]], config: Any) -> Iterator[tuple[str, Any]]:
    """The checkpoint's tensors under ``GroupedMoeBlock``'s names: the fused experts split one by one, the
    shared MLP as ``mlp.shared_expert``, the multi-token-prediction layers (and an empty shared MLP) left out."""
    for name, tensor in weights:
        layer = _LAYER.match(name)
        if layer is not None and int(layer.group(1)) >= config.num_hidden_layers:
            continue  # a multi-token-prediction layer
        if ".mlp.shared_experts." in name:
            if ExpertCounts.of(config).shared:
                yield name.replace(".mlp.shared_experts.", ".mlp.shared_expert."), tensor
        elif name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            yield from _experts_one_by_one(name, tensor)
        else:
            yield name, tensor


def _experts_one_by_one(name: str, tensor: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers' fused expert tensors as one tensor per expert and projection (gate rows above up rows)."""
    if not isinstance(tensor, torch.Tensor):
        raise NotImplementedError(f"{name}: fused experts from a quantized file")
    prefix, projection = name.rsplit(".", 1)
    for expert, weight in enumerate(tensor.unbind(0)):
        if projection == "gate_up_proj":
            gate, up = weight.chunk(2, dim=0)
            yield f"{prefix}.{expert}.gate_proj.weight", gate
            yield f"{prefix}.{expert}.up_proj.weight", up
        else:
            yield f"{prefix}.{expert}.down_proj.weight", weight
