"""The op set's argument checks run before any kernel: on this CPU-only path they name the argument."""

from __future__ import annotations

import pytest
import torch

from core_cuda_backend import ops


def test_every_op_rejects_cpu_tensors_by_name():
    x = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="rms_norm: x must be on a CUDA device, got cpu"):
        ops.rms_norm(x, torch.ones(64), 1e-6)
    with pytest.raises(ValueError, match="silu_and_mul: x must be on a CUDA device"):
        ops.silu_and_mul(x)
    with pytest.raises(ValueError, match="apply_rotary: query must be on a CUDA device"):
        ops.apply_rotary(torch.zeros(2, 4, 64), torch.zeros(2, 2, 64), torch.zeros(2, dtype=torch.int64),
                         torch.zeros(8, 32), torch.zeros(8, 32))
    with pytest.raises(ValueError, match="sample_tokens: logits must be on a CUDA device"):
        ops.sample_tokens(x, torch.ones(2), None, None, None, torch.ones(2, 64))
    cache = torch.zeros(4, 16, 2, 64)
    with pytest.raises(ValueError, match="store_kv_cache: k_cache must be on a CUDA device"):
        ops.store_kv_cache(torch.zeros(1, 2, 64), torch.zeros(1, 2, 64), cache, cache,
                           torch.zeros(1, dtype=torch.int64))


def test_non_tensor_arguments_are_named():
    with pytest.raises(ValueError, match="rms_norm: x must be a tensor, got list"):
        ops.rms_norm([1.0], torch.ones(1), 1e-6)


def test_op_set_has_the_reference_names_and_is_graph_safe(monkeypatch):
    from core_pytorch_backend.kernels import OP_NAMES

    monkeypatch.setattr(ops, "_library", lambda: None)  # no GPU here: skip loading the kernels
    op_set = ops.op_set()
    assert op_set.name == "cuda" and op_set.graph_safe is True
    for name in OP_NAMES:
        assert getattr(op_set, name) is getattr(ops, name)
    assert op_set.sample_tokens is ops.sample_tokens
