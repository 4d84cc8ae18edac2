"""Can the cuda backend run here? Answered without importing torch or initialising a GPU."""

from __future__ import annotations

import os
import shutil

NVIDIA_DRIVER_FILE = "/proc/driver/nvidia/version"


def find_nvcc() -> str | None:
    """The nvcc compiler: $CUDA_HOME/bin/nvcc, else the one on PATH."""
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and os.path.isfile(os.path.join(cuda_home, "bin", "nvcc")):
        return os.path.join(cuda_home, "bin", "nvcc")
    return shutil.which("nvcc")


def unavailable_reason() -> str | None:
    """None when an NVIDIA driver and nvcc are present, else why the backend cannot run."""
    if not os.path.exists(NVIDIA_DRIVER_FILE):
        return f"no NVIDIA GPU driver found ({NVIDIA_DRIVER_FILE} is missing)"
    if find_nvcc() is None:
        return "nvcc was not found (set CUDA_HOME or put nvcc on PATH) to build the CUDA kernels"
    return None
