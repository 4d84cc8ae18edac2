"""The half-precision matmul strategy for CPUs without bf16/fp16 matrix instructions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core_pytorch_backend.layers import Linear, LMHead, VocabEmbedding
from core_pytorch_backend.layers.matmul import UpcastMatmul, select_matmul, use_matmul


def _model() -> torch.nn.Module:
    embed = VocabEmbedding(50, 16)
    model = torch.nn.ModuleDict({"a": Linear(16, 24, bias=True), "b": Linear(24, 16), "embed": embed,
                                 "head": LMHead(50, 16, tie_to=embed)})
    for p in model.parameters():
        p.data.normal_()
    return model.to(torch.bfloat16)


@pytest.mark.parametrize("chunk_elements", [1, 16 * 5, 24 * 16, 10_000])  # 1 output row .. all at once
@pytest.mark.parametrize("rows", [1, 3, 4, 33])
def test_upcast_matmul_equals_float32_gemm_on_the_half_weights(rows, chunk_elements):
    torch.manual_seed(0)
    x = torch.randn(rows, 16, dtype=torch.bfloat16)
    w = torch.randn(24, 16, dtype=torch.bfloat16)
    b = torch.randn(24, dtype=torch.bfloat16)
    out = UpcastMatmul(w.numel(), min_rows=4, chunk_elements=chunk_elements)(x, w, b)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 24)
    if rows >= 4:
        expected = F.linear(x.float(), w.float(), b.float()).to(torch.bfloat16)
        assert torch.equal(out, expected)
    else:  # few rows keep the native half-precision path
        assert torch.equal(out, F.linear(x, w, b))


def test_one_scratch_buffer_serves_weights_of_every_size():
    upcast = UpcastMatmul(24 * 16, min_rows=1)
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    small, big = torch.randn(3, 16, dtype=torch.bfloat16), torch.randn(24, 16, dtype=torch.bfloat16)
    assert torch.equal(upcast(x, big, None), F.linear(x.float(), big.float()).bfloat16())
    assert torch.equal(upcast(x, small, None), F.linear(x.float(), small.float()).bfloat16())
    assert upcast.scratch.numel() == 24 * 16


def test_min_rows_and_chunk_must_be_positive():
    with pytest.raises(ValueError, match="min_rows"):
        UpcastMatmul(4, min_rows=0)
    with pytest.raises(ValueError, match="chunk_elements"):
        UpcastMatmul(4, chunk_elements=0)


def test_select_matmul_only_for_half_precision_on_cpus_without_native_support(monkeypatch):
    model = _model()
    assert select_matmul(model, torch.device("cpu"), torch.float32) is None
    monkeypatch.setattr("core_pytorch_backend.layers.matmul.cpu_has_native_half_matmul", lambda dtype: True)
    assert select_matmul(model, torch.device("cpu"), torch.bfloat16) is None
    monkeypatch.setattr("core_pytorch_backend.layers.matmul.cpu_has_native_half_matmul", lambda dtype: False)
    chosen = select_matmul(model, torch.device("cpu"), torch.bfloat16)
    assert isinstance(chosen, UpcastMatmul)
    assert chosen.scratch.numel() == 50 * 16  # the largest weight (the tied LM head): smaller than a chunk


def test_use_matmul_routes_every_linear_layer_and_the_lm_head():
    model = _model()
    calls = []

    def spy(x, w, b):
        calls.append(tuple(w.shape))
        return F.linear(x, w, b)

    use_matmul(model, spy)
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    model["b"](model["a"](x))
    model["head"](x)
    assert calls == [(24, 16), (16, 24), (50, 16)]
    use_matmul(model, None)
    assert model["a"].matmul is F.linear
