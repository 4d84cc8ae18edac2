"""CudaBackend: the pytorch backend's engine, pinned to a CUDA device.

The hand-written kernels (csrc/) replace the Triton ops through the same dispatch point; until a kernel
exists, the pytorch backend's op for CUDA is used.
"""

from __future__ import annotations

import dataclasses

from core.config import EngineConfig
from core.errors import UnsupportedError
from core_cuda_backend.availability import unavailable_reason
from core_pytorch_backend.backend import PytorchBackend


class CudaBackend(PytorchBackend):
    """The pytorch backend on CUDA; refuses to start without a GPU, with one clear line."""

    def __init__(self, config: EngineConfig) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise UnsupportedError(f"the cuda backend cannot run here: {reason}")
        device = config.device if config.device and config.device.startswith("cuda") else "cuda"
        super().__init__(dataclasses.replace(config, device=device))
