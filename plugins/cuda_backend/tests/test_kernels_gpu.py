"""The CUDA kernels against the plain-torch reference, on a GPU (skipped elsewhere, with the reason).

Edge cases follow the Triton tests: context length 1, lengths off the block size, short and long
sequences mixed, cached prefixes with new chunks, GQA 1/4/8 (and 16), head sizes 64/128, sliding
windows, the split-context decode path (contexts over 512 tokens, and the padded grid a captured CUDA
graph uses). Tolerances (kernel vs reference, same inputs and dtype): float32 2e-5 for attention, 1e-5
for norm / rotary / silu; bfloat16 and float16 2e-2 and 1e-2 abs and rel (about two ulps at 1; the kernels
accumulate in float32 where the reference rounds after each op). KV stores and sampling are exact.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from core_cuda_backend.availability import unavailable_reason
from core_pytorch_backend import kernel_cases
from core_pytorch_backend.kernel_cases import assert_close as _close
from core_pytorch_backend.kernels import reference
from core_pytorch_backend.layers.rotary import compute_inv_freq
from core_pytorch_backend.sampling import sample_tokens

REASON = "no CUDA GPU: torch.cuda.is_available() is False" if not torch.cuda.is_available() else unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=REASON or "")]

DTYPES = [torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 1e-2}
ATTN_TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 1e-2}
GQA = {**kernel_cases.GQA, "gqa16": (16, 1)}
SCENARIOS = {
    **kernel_cases.SCENARIOS,
    "split": [(1500, 1), (3, 1), (700, 1), (0, 1), (511, 1), (512, 1)],  # 1-3 partitions of 512
    "long_prefix": [(600, 40), (0, 70), (1100, 1)],
}


@pytest.fixture(scope="module")
def cuda():
    from core_cuda_backend.ops import op_set

    return op_set()


def _randn(*shape: int, dtype=torch.float32, gen=None) -> torch.Tensor:
    return kernel_cases.randn(*shape, dtype=dtype, gen=gen, device="cuda")


def _paged_problem(seqs, hq, hkv, head_dim, block_size, dtype, seed=0):
    return kernel_cases.paged_problem(seqs, hq, hkv, head_dim, block_size, dtype, "cuda", seed)


# ---------------------------------------------------------------- elementwise ops


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float32])
@pytest.mark.parametrize("hidden", [64, 4096])
def test_rms_norm_with_and_without_residual(cuda, dtype, hidden):
    gen = torch.Generator().manual_seed(0)
    x, res = _randn(7, hidden, dtype=dtype, gen=gen), _randn(7, hidden, dtype=dtype, gen=gen)
    w = (torch.rand(hidden, generator=gen) + 0.5).to("cuda", dtype)
    _close(cuda.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), TOL[dtype])
    out, new_res = cuda.rms_norm(x, w, 1e-6, residual=res)
    want_out, want_res = reference.rms_norm(x, w, 1e-6, residual=res)
    assert torch.equal(new_res, want_res)
    _close(out, want_out, TOL[dtype])


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_with_llama3_tables_on_strided_heads(cuda, dtype, head_dim):
    params = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    angles = torch.outer(torch.arange(512, dtype=torch.float32), compute_inv_freq(head_dim, params))
    cos, sin = angles.cos().cuda(), angles.sin().cuda()
    qkv = _randn(9, (8 + 2 * 2) * head_dim, dtype=dtype, gen=torch.Generator().manual_seed(1))
    q, k = qkv[:, : 8 * head_dim].view(9, 8, head_dim), qkv[:, 8 * head_dim : 10 * head_dim].view(9, 2, head_dim)
    positions = torch.tensor([0, 1, 2, 5, 17, 100, 3, 511, 64], device="cuda")
    for ours, want in zip(cuda.apply_rotary(q, k, positions, cos, sin),
                          reference.apply_rotary(q, k, positions, cos, sin), strict=True):
        _close(ours, want, TOL[dtype])


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float32])
def test_silu_and_mul(cuda, dtype):
    x = _randn(5, 2 * 1376, dtype=dtype, gen=torch.Generator().manual_seed(2))
    _close(cuda.silu_and_mul(x), reference.silu_and_mul(x), TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_cache_is_exact_on_strided_inputs_and_skips_negative_slots(cuda, dtype):
    kernel_cases.check_store_kv_cache(cuda.store_kv_cache, dtype, "cuda")


# ---------------------------------------------------------------- paged attention


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", list(GQA.values()), ids=list(GQA))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_paged_attention(cuda, scenario, head_dim, heads, dtype):
    block_size = 4 if head_dim == 64 else 16
    q, k_cache, v_cache, meta = _paged_problem(SCENARIOS[scenario], *heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    _close(cuda.paged_attention(q, k_cache, v_cache, meta, scale),
           reference.paged_attention(q, k_cache, v_cache, meta, scale), ATTN_TOL[dtype])


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("window", [5, 600])
def test_paged_attention_sliding_window_float32(cuda, scenario, window):
    q, k_cache, v_cache, meta = _paged_problem(SCENARIOS[scenario], 8, 2, 64, 4, torch.float32)
    _close(cuda.paged_attention(q, k_cache, v_cache, meta, 0.125, window),
           reference.paged_attention(q, k_cache, v_cache, meta, 0.125, window), ATTN_TOL[torch.float32])


def test_decode_on_the_padded_grid_of_a_captured_graph(cuda):
    """max_seq_len far above every real length (as the graph runner passes it): empty splits are skipped."""
    q, k_cache, v_cache, meta = _paged_problem(SCENARIOS["split"], 8, 2, 128, 16, torch.bfloat16)
    padded = dataclasses.replace(meta, max_seq_len=8192)  # (a fresh op_cache)
    _close(cuda.paged_attention(q, k_cache, v_cache, padded, 128**-0.5),
           reference.paged_attention(q, k_cache, v_cache, meta, 128**-0.5), ATTN_TOL[torch.bfloat16])


def test_paged_attention_rejects_an_unsupported_head_size(cuda):
    q, k_cache, v_cache, meta = _paged_problem([(3, 1)], 4, 2, 64, 4, torch.float16)
    with pytest.raises(ValueError, match="head_dim must be one of"):
        cuda.paged_attention(q[..., :32].contiguous(), k_cache[..., :32].contiguous(),
                             v_cache[..., :32].contiguous(), meta, 1.0)


# ---------------------------------------------------------------- sampling


def test_sampling_matches_the_samplers_truncation_and_race(cuda):
    """Same Exp(1) noise -> the same tokens as sampling.py's top-k / top-p / min-p + exponential race."""
    gen = torch.Generator().manual_seed(5)
    rows, vocab = 48, 3000
    logits = (torch.randn(rows, vocab, generator=gen) * 3).cuda()
    temperature = torch.tensor([0.0 if i % 7 == 0 else 0.5 + (i % 4) * 0.3 for i in range(rows)], device="cuda")
    top_k = torch.tensor([[0, 1, 5, 50, 4000][i % 5] for i in range(rows)], device="cuda")
    omp = torch.tensor([[0.0, 0.1, 0.5, 0.95][i % 4] for i in range(rows)], device="cuda")
    min_p = torch.tensor([[0.0, 0.0, 0.05][i % 3] for i in range(rows)], device="cuda")
    noise = torch.empty(rows, vocab, device="cuda").exponential_(generator=torch.Generator("cuda").manual_seed(6))
    ours = cuda.sample_tokens(logits, temperature, top_k, omp, min_p, noise)
    sampled = temperature > 0
    want = logits.argmax(-1)
    want[sampled] = sample_tokens(logits[sampled], temperature[sampled], top_k[sampled], omp[sampled],
                                  min_p[sampled], noise[sampled])
    assert ours.tolist() == want.tolist()


def test_sampling_top_k_1_is_greedy_and_top_p_keeps_the_nucleus(cuda):
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)]] * 4000, device="cuda")
    noise = torch.empty_like(logits).exponential_()
    ones = torch.ones(4000, device="cuda")
    assert set(cuda.sample_tokens(logits, ones, torch.ones(4000, dtype=torch.int64, device="cuda"), None, None,
                                  noise).tolist()) == {0}
    omp = torch.full((4000,), 1 - 0.7, device="cuda")  # top_p 0.7: {0.5, 0.3} reach it, 0.15 is not needed
    counts = torch.bincount(cuda.sample_tokens(logits, ones, None, omp, None, noise), minlength=4)
    assert counts[2:].sum() == 0 and 0.55 < counts[0] / 4000 < 0.70  # 0.5 / 0.8 = 0.625
