"""CudaBackend: the pytorch backend's engine on a CUDA device, its hot ops on the hand-written kernels.

The kernels (csrc/, built by build.py, called through library.py) replace the pytorch backend's op set
through its one dispatch point (``PytorchBackend._select_ops``); the models, scheduler, sampler and the
CUDA-graph runner (cuda_graphs.py, which captures decode steps because this op set is graph-safe) are
the pytorch backend's own.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from core.config import EngineConfig
from core.errors import UnsupportedError
from core_cuda_backend.availability import unavailable_reason
from core_pytorch_backend.backend import PytorchBackend
from core_pytorch_backend.layers.attention import attention_layers
from core_pytorch_backend.loader import LoadedModel


class CudaBackend(PytorchBackend):
    """The pytorch backend on CUDA with the kernels of csrc/; refuses to start without a GPU, with one line."""

    def __init__(self, config: EngineConfig) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise UnsupportedError(f"the cuda backend cannot run here: {reason}")
        device = config.device if config.device and config.device.startswith("cuda") else "cuda"
        super().__init__(dataclasses.replace(config, device=device))

    def _select_ops(self) -> SimpleNamespace:
        from core_cuda_backend.ops import op_set

        return op_set()

    def _load(self) -> LoadedModel:
        loaded = super()._load()
        _check_attention_shapes(loaded)
        return loaded


def _check_attention_shapes(loaded: LoadedModel) -> None:
    """The kernels hold head sizes 64 and 128 and up to 16 query heads per KV head: say so at load."""
    from core_cuda_backend.ops import HEAD_DIMS, MAX_GROUP

    for layer in attention_layers(loaded.model):
        group = layer.num_heads // layer.num_kv_heads
        if layer.head_dim not in HEAD_DIMS or group > MAX_GROUP:
            raise UnsupportedError(
                f"the cuda backend's kernels support head sizes {HEAD_DIMS} with at most {MAX_GROUP} query "
                f"heads per KV head; this model has head size {layer.head_dim} and {group} (use --backend pytorch)"
            )
