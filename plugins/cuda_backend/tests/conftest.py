"""Fixtures of the cuda backend's tests: tiny random checkpoints whose head size the kernels hold (64).

The checkpoint builder is the pytorch backend's test helper, loaded by path (its tests are not a package).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

PYTORCH_TESTS = Path(__file__).resolve().parents[2] / "pytorch_backend" / "tests"
HEAD_64 = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)


def _pytorch_test_helpers():
    spec = importlib.util.spec_from_file_location("core_pytorch_backend_test_helpers", PYTORCH_TESTS / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def build_tiny_checkpoint():
    """``build_tiny_checkpoint(arch, folder, seed=0, **config_overrides) -> Path`` (pytorch backend's helper)."""
    return _pytorch_test_helpers().build_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_llama_64(tmp_path_factory, build_tiny_checkpoint) -> Path:
    """A 2-layer random Llama with head size 64 (4 query heads, 2 KV heads), float32 safetensors."""
    return build_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny-llama-64"), **HEAD_64)
