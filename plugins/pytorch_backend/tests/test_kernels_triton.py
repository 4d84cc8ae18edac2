"""The Triton op set against the reference op set: under TRITON_INTERPRET=1 on CPU tensors (set by
conftest.py when there is no GPU), natively on a CUDA machine.

Tolerances (Triton vs reference, same inputs, same dtype):
- float32: 2e-5 abs and rel for attention (base-2 online softmax, other summation order), 1e-5 for
  norm / rotary / silu; the KV store is exact.
- bfloat16: 2e-2 abs and rel (about two bf16 ulps at 1): the kernels compute in float32 and round once,
  the reference rounds after each torch op, and the interpreter truncates float32 -> bfloat16.
Shapes are tiny: the interpreter runs each program in Python (about 0.1-1 s a launch here).
"""

from __future__ import annotations

import pytest
import torch

from core_pytorch_backend.attention_metadata import AttentionMetadata
from core_pytorch_backend.kernel_cases import GQA, SCENARIOS, check_store_kv_cache, paged_problem, randn
from core_pytorch_backend.kernel_cases import assert_close as _close
from core_pytorch_backend.kernels import reference, select_ops
from core_pytorch_backend.layers.rotary import RotaryEmbedding

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = select_ops(DEVICE, kind="triton")
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
ATTN_TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _randn(*shape: int, dtype=torch.float32, gen=None) -> torch.Tensor:
    return randn(*shape, dtype=dtype, gen=gen, device=DEVICE)


def _paged_problem(seqs, hq, hkv, head_dim, block_size, dtype, seed=0):
    return paged_problem(seqs, hq, hkv, head_dim, block_size, dtype, DEVICE, seed)


# ---------------------------------------------------------------- dispatch


def test_select_ops_reference_on_cpu_triton_when_forced(monkeypatch):
    monkeypatch.delenv("CORE_KERNELS", raising=False)
    assert select_ops("cpu").name in ("native", "reference") and not select_ops("cpu").graph_safe
    assert TRITON.name == "triton" and TRITON.graph_safe
    assert TRITON.paged_attention is not reference.paged_attention
    monkeypatch.setenv("CORE_KERNELS", "triton")
    assert select_ops(DEVICE).name == "triton"
    assert select_ops(DEVICE, kind="reference").name == "reference"  # the argument wins over the env


def test_select_ops_rejects_unknown_kind_and_uninterpreted_cpu(monkeypatch):
    with pytest.raises(ValueError, match="kind .* got 'cuda-graphs'"):
        select_ops("cpu", kind="cuda-graphs")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        select_ops("cpu", kind="triton")


# ---------------------------------------------------------------- elementwise ops


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
def test_rms_norm(dtype, hidden):
    gen = torch.Generator().manual_seed(0)
    x, res = _randn(5, hidden, dtype=dtype, gen=gen), _randn(5, hidden, dtype=dtype, gen=gen)
    w = (torch.rand(hidden, generator=gen) + 0.5).to(DEVICE, dtype)
    _close(TRITON.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), TOL[dtype])
    ours, ours_res = TRITON.rms_norm(x, w, 1e-6, residual=res)
    want, want_res = reference.rms_norm(x, w, 1e-6, residual=res)
    _close(ours_res, want_res, TOL[dtype])
    _close(ours, want, TOL[dtype])


def test_rms_norm_on_strided_heads_and_bad_weight():
    """q_norm / k_norm normalise [T, H, D] views of a fused projection (not contiguous)."""
    fused = _randn(3, 4 * 16 + 32)
    heads = fused[:, :64].reshape(3, 4, 16)
    w = _randn(16)
    _close(TRITON.rms_norm(heads, w, 1e-6), reference.rms_norm(heads, w, 1e-6), TOL[torch.float32])
    with pytest.raises(ValueError, match="weight must have shape"):
        TRITON.rms_norm(heads, _randn(8), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_with_llama3_scaled_tables(dtype, head_dim):
    """The tables come from layers/rotary.py with Llama 3 scaling folded in; q is a strided view."""
    params = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    rope = RotaryEmbedding(head_dim, 512, params, TRITON).to(DEVICE)
    gen = torch.Generator().manual_seed(1)
    qk = _randn(6, (8 + 2) * head_dim, dtype=dtype, gen=gen)
    q, k = qk[:, : 8 * head_dim].view(6, 8, head_dim), qk[:, 8 * head_dim :].view(6, 2, head_dim)
    positions = torch.tensor([0, 1, 63, 64, 300, 511], device=DEVICE)
    ours = TRITON.apply_rotary(q, k, positions, rope.cos_cache, rope.sin_cache)
    want = reference.apply_rotary(q, k, positions, rope.cos_cache, rope.sin_cache)
    _close(ours[0], want[0], TOL[dtype])
    _close(ours[1], want[1], TOL[dtype])


def test_rotary_rejects_mismatched_tables():
    q, k = _randn(2, 4, 64), _randn(2, 2, 64)
    with pytest.raises(ValueError, match="cos_cache / sin_cache must be"):
        TRITON.apply_rotary(q, k, torch.zeros(2, dtype=torch.int64, device=DEVICE), _randn(8, 64), _randn(8, 64))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = _randn(3, 2, 2 * 1100, dtype=dtype, gen=torch.Generator().manual_seed(2))  # 2 column blocks
    _close(TRITON.silu_and_mul(x), reference.silu_and_mul(x), TOL[dtype])
    with pytest.raises(ValueError, match="must be even"):
        TRITON.silu_and_mul(x[..., :-1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_cache_matches_reference_and_skips_negative_slots(dtype):
    check_store_kv_cache(TRITON.store_kv_cache, dtype, DEVICE)


# ---------------------------------------------------------------- paged attention


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", list(GQA.values()), ids=list(GQA))
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_paged_attention(scenario, head_dim, heads, dtype):
    block_size = 4 if head_dim == 64 else 16
    q, k_cache, v_cache, meta = _paged_problem(SCENARIOS[scenario], *heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    _close(TRITON.paged_attention(q, k_cache, v_cache, meta, scale),
           reference.paged_attention(q, k_cache, v_cache, meta, scale), ATTN_TOL[dtype])


def test_prefill_attention_long_prompt_spans_query_tiles():
    """A 70-token prompt beside a 3-token one: several query and key tiles, causal across them."""
    q, k_cache, v_cache, meta = _paged_problem([(0, 70), (2, 3)], 8, 2, 64, 16, torch.float32)
    _close(TRITON.paged_attention(q, k_cache, v_cache, meta, 0.125),
           reference.paged_attention(q, k_cache, v_cache, meta, 0.125), ATTN_TOL[torch.float32])


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_paged_attention_sliding_window(scenario):
    q, k_cache, v_cache, meta = _paged_problem(SCENARIOS[scenario], 8, 2, 64, 4, torch.float32)
    _close(TRITON.paged_attention(q, k_cache, v_cache, meta, 0.125, 5),
           reference.paged_attention(q, k_cache, v_cache, meta, 0.125, 5), ATTN_TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits,window", [(3, None), (8, None), (4, 9)])
def test_decode_split_k_merges_splits(num_splits, window, dtype):
    """Split-K: splits that hold nothing (short sequences), splits cut mid-block, and a window."""
    from core_pytorch_backend.kernels.triton.decode_attention import decode_attention

    q, k_cache, v_cache, meta = _paged_problem(SCENARIOS["decode"], 8, 2, 64, 4, dtype)
    ours = decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.125, window, num_splits)
    _close(ours, reference.paged_attention(q, k_cache, v_cache, meta, 0.125, window), ATTN_TOL[dtype])


def test_default_num_splits():
    from core_pytorch_backend.kernels.triton.decode_attention import default_num_splits

    cpu = torch.device("cpu")  # one "SM": never splits
    assert default_num_splits(1, 8, 8192, cpu) == 1
    if torch.cuda.is_available():
        gpu = torch.device("cuda")
        assert default_num_splits(1, 8, 8192, gpu) > 1  # one sequence: spread it over the SMs
        assert default_num_splits(1, 8, 256, gpu) == 1  # short capacity: never below 256 tokens a split
        assert default_num_splits(256, 8, 8192, gpu) == 1  # enough programs already


# ---------------------------------------------------------------- a whole model


@torch.inference_mode()
def _greedy(model, prompt, new_tokens, block_size=4):
    """Prefill then decode one sequence through the paged cache; the greedy tokens."""
    from core_pytorch_backend.layers import allocate_kv_caches, unbind_kv_caches

    table = list(range(-(-(len(prompt) + new_tokens) // block_size)))[::-1]
    allocate_kv_caches(model, len(table), block_size)
    out, chunk, computed = [], prompt, 0
    for _ in range(new_tokens):
        meta = AttentionMetadata.build([computed], [len(chunk)], [table], block_size, DEVICE)
        hidden = model(torch.tensor(chunk, device=DEVICE), meta.positions(), meta)
        out.append(int(model.compute_logits(hidden[-1:]).argmax(-1)))
        computed, chunk = computed + len(chunk), [out[-1]]
    unbind_kv_caches(model)
    return out


def test_tiny_model_greedy_output_matches_reference_ops(tiny_checkpoint_factory):
    from core_pytorch_backend.loader import load_checkpoint

    path = tiny_checkpoint_factory("llama")
    prompt = [5, 80, 17, 200, 33, 9, 101]
    outputs = {kind: _greedy(load_checkpoint(path, dtype="float32", device=DEVICE,
                                             ops=select_ops(DEVICE, kind=kind)).model, prompt, 4)
               for kind in ("reference", "triton")}
    assert outputs["triton"] == outputs["reference"]
