"""EXAONE MoE (``ExaoneMoeForCausalLM``: K-EXAONE-236B-A23B): EXAONE 4.0's attention (models/exaone4.py: q and k
RMS-normalized head by head before rotary; where a window is set, the windowed layers ``layer_types`` names take
rotary and the global ones none) in Llama's pre-norm layers (not EXAONE 4.0's post-norm ones), with DeepSeek-V3's
mixture of experts (models/grouped_router.py: ``noaux_tc`` routing over ``num_experts``, a shared MLP
``num_shared_experts`` experts wide, dense MLPs where ``mlp_layer_types`` says). The checkpoints hold the router's
correction bias as ``mlp.e_score_correction_bias``, and multi-token-prediction weights (``mtp.*``) that are skipped,
as transformers skips them. Following transformers' ``modeling_exaone_moe``."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from ..quant.attach import QuantizedShards
from .exaone4 import Exaone4ForCausalLM
from .grouped_router import GroupedMoeCheckpoint, GroupedMoeModel
from .llama import DecoderSpec, LlamaForCausalLM


class ExaoneMoeForCausalLM(GroupedMoeCheckpoint, LlamaForCausalLM):
    model_class = GroupedMoeModel
    #: per-head q/k norms and experts are not split across ranks
    tensor_parallel_plan = None

    @classmethod
    def decoder_spec(cls, config: Any) -> DecoderSpec:
        return Exaone4ForCausalLM.decoder_spec(config)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> QuantizedShards:
        return super().load_weights(_our_names(weights))


def _our_names(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    for name, tensor in weights:
        if not name.startswith("mtp."):
            yield name.replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"), tensor
