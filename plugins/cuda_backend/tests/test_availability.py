"""Without a GPU the cuda backend reports why it is unavailable and refuses to start with one line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from core.config import EngineConfig
from core.errors import UnsupportedError
from core_cuda_backend import availability

NO_GPU = not os.path.exists(availability.NVIDIA_DRIVER_FILE)


def test_reason_names_the_missing_driver(monkeypatch):
    monkeypatch.setattr(availability, "NVIDIA_DRIVER_FILE", "/nonexistent/nvidia/version")
    assert "no NVIDIA GPU driver" in availability.unavailable_reason()


def test_reason_names_a_missing_nvcc(monkeypatch, tmp_path):
    driver = tmp_path / "version"
    driver.write_text("NVRM fake")
    monkeypatch.setattr(availability, "NVIDIA_DRIVER_FILE", str(driver))
    monkeypatch.setattr(availability, "find_nvcc", lambda: None)
    assert "nvcc was not found" in availability.unavailable_reason()


@pytest.mark.skipif(not NO_GPU, reason="this machine has an NVIDIA driver")
def test_backend_refuses_to_start_without_a_gpu():
    from core_cuda_backend.backend import CudaBackend

    with pytest.raises(UnsupportedError, match="cannot run here"):
        CudaBackend(EngineConfig())


@pytest.mark.skipif(not NO_GPU, reason="this machine has an NVIDIA driver")
def test_core_serve_backend_cuda_exits_with_one_clear_line():
    result = subprocess.run([sys.executable, "-m", "core.cli", "serve", "--backend", "cuda"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "core serve: error: backend 'cuda' is not available here: no NVIDIA GPU driver found "
        f"({availability.NVIDIA_DRIVER_FILE} is missing)"
    ]
    assert "Traceback" not in result.stderr
