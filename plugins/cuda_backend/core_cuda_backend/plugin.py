"""Hook implementations of the cuda backend.

It is preferred over the pytorch backend (priority 20 vs 10) where it can run; `available` reports why
not elsewhere, without importing torch.
"""

from __future__ import annotations

from core import hookimpl
from core_cuda_backend.availability import unavailable_reason


@hookimpl
def core_register_backends(register):
    register("cuda", "core_cuda_backend.backend:CudaBackend", priority=20, available=unavailable_reason,
             description="the pytorch backend's models and scheduler with hand-written CUDA kernels")
