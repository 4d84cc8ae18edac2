"""How a model is cut into tensor-parallel shards: the kind of each weight, and the shape checks.

A model class declares ``tensor_parallel_plan``: the suffix of an HF module name (``"mlp.down_proj"``)
mapped to one of the kinds below; every other weight is replicated. The sharded model is the same class
built from `sharded_config` (1/N of the heads, the MLP width and the padded vocabulary), so each rank's
parameters have their shard's shape and an unsharded tensor cannot load by mistake.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

COLUMN = "column"  # output rows split evenly (q, gate, up): no communication
KV_COLUMN = "kv_column"  # output rows split by KV head; replicated when there are fewer KV heads than ranks
ROW = "row"  # input columns split evenly (o, down): the partial outputs are all-reduced
VOCAB = "vocab"  # rows split by vocabulary range: masked lookup + all-reduce, or logits gathered
KINDS = (COLUMN, KV_COLUMN, ROW, VOCAB)
FLAG = "--tensor-parallel-size"


@dataclass(frozen=True)
class ShardLayout:
    """What rank `rank` of `world` holds of a model: head counts, widths and its vocabulary range."""

    rank: int
    world: int
    num_heads: int  # query heads per rank
    num_kv_heads: int  # KV heads per rank (1 when replicated)
    kv_replicas: int  # ranks that hold the same KV head (1: none replicated)
    head_dim: int
    vocab_size: int  # the whole vocabulary
    vocab_per_rank: int  # rows of the embedding and the LM head per rank (the last one padded)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    @property
    def kv_head_start(self) -> int:
        """The first KV head this rank holds."""
        return (self.rank // self.kv_replicas) * self.num_kv_heads


def layout_of(config: Any, rank: int, world: int) -> ShardLayout:
    """The layout of rank `rank`, or a ValueError naming --tensor-parallel-size when the model's heads or
    MLP width do not split into `world` parts (KV heads fewer than ranks are replicated, as vLLM does,
    when the ranks are a multiple of them)."""
    text = config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if heads % world:
        raise ValueError(f"{FLAG} {world} must divide the model's {heads} attention heads")
    if kv_heads >= world and kv_heads % world or kv_heads < world and world % kv_heads:
        raise ValueError(f"{FLAG} {world} must divide the model's {kv_heads} KV heads or be a multiple of "
                         "them")
    inter = getattr(text, "intermediate_size", None)
    if inter is not None and inter % world:
        raise ValueError(f"{FLAG} {world} must divide the model's MLP width (intermediate_size {inter})")
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return ShardLayout(rank=rank, world=world, num_heads=heads // world,
                       num_kv_heads=max(kv_heads // world, 1), kv_replicas=max(world // kv_heads, 1),
                       head_dim=head_dim, vocab_size=text.vocab_size,
                       vocab_per_rank=-(-text.vocab_size // world))


def sharded_config(config: Any, layout: ShardLayout) -> Any:
    """A copy of `config` whose model is one shard: the per-rank heads, MLP width and vocabulary rows."""
    shard = copy.deepcopy(config)
    text = shard.get_text_config()
    text.head_dim = layout.head_dim  # else derived from hidden_size / heads, which the split would change
    text.num_attention_heads = layout.num_heads
    text.num_key_value_heads = layout.num_kv_heads
    if getattr(text, "intermediate_size", None) is not None:
        text.intermediate_size //= layout.world
    text.vocab_size = layout.vocab_per_rank
    return shard


def plan_of(model_class: type) -> Mapping[str, str]:
    """The class's ``tensor_parallel_plan``, checked; a ValueError naming the flag when it has none."""
    plan = getattr(model_class, "tensor_parallel_plan", None)
    if not plan:
        raise ValueError(f"{model_class.__name__} cannot be sharded ({FLAG} > 1): its model class "
                         "declares no tensor_parallel_plan")
    for suffix, kind in plan.items():
        if kind not in KINDS:
            raise ValueError(f"{model_class.__name__}.tensor_parallel_plan[{suffix!r}] is {kind!r}, "
                             f"not one of {KINDS}")
    return plan


def kind_of(param_name: str, plan: Mapping[str, str]) -> str | None:
    """The kind of the weight or bias `param_name` (an HF name), None when it is replicated."""
    module = param_name.rsplit(".", 1)[0]
    for suffix, kind in plan.items():
        if module == suffix or module.endswith("." + suffix):
            return kind
    return None
