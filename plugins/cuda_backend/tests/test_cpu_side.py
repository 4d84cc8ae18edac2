"""CPU-side behaviour of the cuda backend: the load-time shape check, and the GPU check's join with
benchmarks/gpu_check.py (whose extension point must keep the names gpu_check_cuda.py relies on)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from core.errors import UnsupportedError

ROOT = Path(__file__).resolve().parents[3]


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_head_sizes_the_kernels_lack_are_refused_at_load(tmp_path, build_tiny_checkpoint):
    from core_cuda_backend.backend import _check_attention_shapes
    from core_pytorch_backend.loader import load_checkpoint

    head_16 = load_checkpoint(build_tiny_checkpoint("llama", tmp_path / "h16"), dtype="float32")
    with pytest.raises(UnsupportedError, match="head size 16 and 2 .*use --backend pytorch"):
        _check_attention_shapes(head_16)
    head_64 = load_checkpoint(build_tiny_checkpoint("llama", tmp_path / "h64", hidden_size=256,
                                                    num_attention_heads=4, num_key_value_heads=2), dtype="float32")
    _check_attention_shapes(head_64)  # supported: no error


def test_gpu_check_cuda_adds_a_cuda_column_to_gpu_check():
    join = _load(ROOT / "benchmarks" / "gpu_check_cuda.py", "gpu_check_cuda_under_test")
    check = join.load_gpu_check()
    join.add_cuda_column(check, with_reference=False)
    assert list(check.OP_SETS) == ["triton", "cuda"]
    for test_file in check.OP_SETS["cuda"]["kernel_tests"]:
        assert (ROOT / test_file).is_file(), test_file
    assert check.select.__name__ == "select" and check.select.__module__ != check.__name__  # wrapped
    for name in ("main", "time_ms", "sampler_timing", "Sizes", "Table"):
        assert hasattr(check, name), f"benchmarks/gpu_check.py no longer has {name}"
