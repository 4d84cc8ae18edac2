"""dots.llm1 (``Dots1ForCausalLM``, rednote-hilab): Qwen3's attention (q and k RMS-normalized per head, biases
on q/k/v/o where ``attention_bias``, a window on the layers ``layer_types`` names) and DeepSeek-V3's mixture of
experts (models/grouped_router.py: ``noaux_tc`` routing, a shared MLP, dense MLPs on the first
``first_k_dense_replace`` layers). Following transformers' ``modeling_dots1``."""

from __future__ import annotations

from .grouped_router import GroupedMoeCheckpoint, GroupedMoeModel
from .qwen3 import Qwen3ForCausalLM


class Dots1ForCausalLM(GroupedMoeCheckpoint, Qwen3ForCausalLM):
    model_class = GroupedMoeModel
    #: experts are not split across ranks
    tensor_parallel_plan = None
