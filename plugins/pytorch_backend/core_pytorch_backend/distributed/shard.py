"""`ModelShard`: what `loader.load_checkpoint` asks to build one rank's part of a model.

Three steps at load time: the config the shard is built from (checked against the tensor-parallel
size: a clear error at start-up, never mid-request), the checkpoint's tensors cut to this rank's slices
as they stream in, and the collectives attached to the loaded layers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from torch import nn

from .group import RankGroups
from .parallel_layers import parallelize
from .plan import ShardLayout, layout_of, plan_of, sharded_config
from .slicing import Tensor, shard_weights

log = logging.getLogger(__name__)


class ModelShard:
    """Rank `groups.rank` of `groups.world`: its layout and plan are fixed by `model_config`."""

    def __init__(self, groups: RankGroups) -> None:
        self.groups = groups
        self.plan: Mapping[str, str] = {}
        self.layout: ShardLayout | None = None

    @property
    def rank(self) -> int:
        return self.groups.rank

    @property
    def world(self) -> int:
        return self.groups.world

    def model_config(self, config: Any, architectures: Mapping[str, Any]) -> Any:
        """The config of this rank's model; a ValueError naming --tensor-parallel-size when the model's
        class declares no plan or its heads or MLP width do not split."""
        from ..loader import architecture_of
        from ..models import resolve_class

        arch = architecture_of(config)
        if arch not in architectures:
            supported = ", ".join(sorted(architectures))
            raise ValueError(f"unsupported architecture {arch!r}; supported: {supported}")
        self.plan = plan_of(resolve_class(architectures[arch]))
        self.layout = layout_of(config, self.rank, self.world)
        return sharded_config(config, self.layout)

    def weights(self, weights: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """This rank's slice of each checkpoint tensor."""
        assert self.layout is not None, "model_config first"
        return shard_weights(weights, self.plan, self.layout)

    def parallelize(self, model: nn.Module) -> None:
        """Attach the all-reduces and gathers to the loaded shard."""
        assert self.layout is not None, "model_config first"
        count = parallelize(model, self.plan, self.layout, self.groups)
        log.debug("rank %d/%d: %d layers communicate", self.rank, self.world, count)
