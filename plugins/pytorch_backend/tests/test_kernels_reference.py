"""The plain-torch ops against naive formulas.

Tolerances: float32 results within 1e-5 (abs) of a float64 naive computation; bfloat16 within
3e-2 abs (norm / rotary / silu, relative to values of order 1) and 2e-2 abs for attention outputs
(softmax-weighted averages of N(0, 1) values).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from core_pytorch_backend.attention_metadata import AttentionMetadata
from core_pytorch_backend.kernels import reference as ops
from core_pytorch_backend.kernels import select_ops
from core_pytorch_backend.layers.rotary import default_inv_freq

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
ATTN_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16]


def test_select_ops_gives_reference_when_asked_or_where_the_native_kernels_cannot_build(monkeypatch):
    chosen = select_ops("cpu", kind="reference")
    assert chosen.name == "reference"
    assert chosen.paged_attention is ops.paged_attention
    import core_pytorch_backend.kernels as kernels

    monkeypatch.setattr(kernels, "native_available", lambda: False)
    assert select_ops("cpu").name == "reference"


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype):
    x = torch.randn(7, 64, dtype=torch.float64)
    res = torch.randn(7, 64, dtype=torch.float64)
    w = torch.rand(64, dtype=torch.float64) + 0.5
    eps = 1e-6

    def naive(h):
        return h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w

    out = ops.rms_norm(x.to(dtype), w.to(dtype), eps)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), naive(x), atol=TOL[dtype], rtol=TOL[dtype])
    out, new_res = ops.rms_norm(x.to(dtype), w.to(dtype), eps, residual=res.to(dtype))
    torch.testing.assert_close(new_res.double(), x + res, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(out.double(), naive(x + res), atol=2 * TOL[dtype], rtol=2 * TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_is_hf_llamas_formula_bit_for_bit(dtype):
    """The fused torch.rms_norm must give exactly HF's float32 steps (greedy parity rests on it)."""
    x, res = torch.randn(5, 576).to(dtype), torch.randn(5, 576).to(dtype)
    w = (torch.rand(576) + 0.5).to(dtype)
    h = (x + res).float()
    want = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    out, new_res = ops.rms_norm(x, w, 1e-5, residual=res)
    assert torch.equal(out, want) and torch.equal(new_res, x + res)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_matches_pairwise_rotation(dtype, head_dim):
    t, hq, hk = 9, 4, 2
    q = torch.randn(t, hq, head_dim, dtype=torch.float64)
    k = torch.randn(t, hk, head_dim, dtype=torch.float64)
    positions = torch.tensor([0, 1, 2, 5, 17, 100, 3, 255, 64])
    inv_freq = default_inv_freq(head_dim, 10000.0)
    angles = torch.outer(torch.arange(256, dtype=torch.float32), inv_freq)
    q_out, k_out = ops.apply_rotary(q.to(dtype), k.to(dtype), positions, angles.cos(), angles.sin())

    def naive(x):
        theta = positions[:, None].double() * inv_freq.double()[None, :]
        cos, sin = theta.cos()[:, None, :], theta.sin()[:, None, :]
        x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2 :]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    torch.testing.assert_close(q_out.double(), naive(q), atol=TOL[dtype] * 3, rtol=TOL[dtype])
    torch.testing.assert_close(k_out.double(), naive(k), atol=TOL[dtype] * 3, rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_of_qkv_views_is_the_per_tensor_formula_bit_for_bit(dtype):
    """q and k rotate as one tensor; each must still equal ``x * cos + roll(x) * [-sin, sin]`` exactly,
    also for the strided views of a fused qkv projection that the models pass."""
    angles = torch.outer(torch.arange(64, dtype=torch.float32), default_inv_freq(64, 10000.0))
    qkv = torch.randn(4, (6 + 2 + 2) * 64).to(dtype)
    q, k = qkv[:, : 6 * 64].view(4, 6, 64), qkv[:, 6 * 64 : 8 * 64].view(4, 2, 64)
    positions = torch.tensor([0, 7, 8, 63])
    cos = torch.cat((angles.cos(), angles.cos()), -1)[positions][:, None].to(dtype)
    sin = torch.cat((-angles.sin(), angles.sin()), -1)[positions][:, None].to(dtype)
    q_out, k_out = ops.apply_rotary(q, k, positions, angles.cos(), angles.sin())
    assert torch.equal(q_out, q * cos + torch.roll(q, 32, -1) * sin)
    assert torch.equal(k_out, k * cos + torch.roll(k, 32, -1) * sin)


def test_rotary_rows_shared_within_a_step_follow_changed_positions():
    """Every layer of a step reuses one set of cos/sin rows; a positions buffer changed in place, new
    values, or other tables must not be served stale rows."""
    angles = torch.outer(torch.arange(64, dtype=torch.float32), default_inv_freq(32, 10000.0))
    cos, sin = angles.cos(), angles.sin()
    q, k = torch.randn(3, 2, 32), torch.randn(3, 1, 32)

    def fresh(positions, cos_cache, sin_cache):
        return ops.apply_rotary(q, k, positions.clone(), cos_cache.clone(), sin_cache.clone())

    positions = torch.tensor([1, 2, 3])
    first = ops.apply_rotary(q, k, positions, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(first, ops.apply_rotary(q, k, positions, cos, sin), strict=False))
    positions.add_(10)  # the same tensor, new values
    for got, want in zip(ops.apply_rotary(q, k, positions, cos, sin), fresh(positions, cos, sin), strict=False):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert not torch.equal(ops.apply_rotary(q, k, positions, cos, sin)[0], first[0])
    for got, want in zip(ops.apply_rotary(q, k, positions, sin, cos), fresh(positions, sin, cos), strict=False):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    x = torch.randn(5, 2 * 96, dtype=torch.float64)
    gate, up = x[:, :96], x[:, 96:]
    want = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(ops.silu_and_mul(x.to(dtype)).double(), want, atol=TOL[dtype], rtol=TOL[dtype])


def test_store_kv_cache_writes_slots_and_skips_negative():
    k_cache = torch.zeros(4, 4, 2, 8)
    v_cache = torch.zeros(4, 4, 2, 8)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    ops.store_kv_cache(key, value, k_cache, v_cache, torch.tensor([13, -1, 2]))
    assert torch.equal(k_cache[3, 1], key[0]) and torch.equal(v_cache[3, 1], value[0])
    assert torch.equal(k_cache[0, 2], key[2]) and torch.equal(v_cache[0, 2], value[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 2


def test_store_kv_cache_without_negative_slots_and_with_none():
    k_cache, v_cache = torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8)
    key, value = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    ops.store_kv_cache(key, value, k_cache, v_cache, torch.tensor([5, 0]))
    assert torch.equal(k_cache[1, 1], key[0]) and torch.equal(v_cache[0, 0], value[1])
    ops.store_kv_cache(key[:0], value[:0], k_cache, v_cache, torch.tensor([], dtype=torch.int64))
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 2


# ---------------------------------------------------------------- paged attention


def _naive_attention(q, k, v, context, scale, window, softcap=None, alibi_slopes=None, sinks=None, chunk=None):
    """q [n, Hq, D] for the last n of k/v [L, Hkv, D]'s positions, in float64; the score terms as their
    papers write them: tanh capping, ALiBi's slope * (j - i), a sink logit in each head's softmax."""
    n, hq, _ = q.shape
    group = hq // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    out = torch.empty(n, hq, v.shape[-1], dtype=torch.float64)
    for i in range(n):
        pos = context + i
        lo = 0 if window is None else max(0, pos - window + 1)
        if chunk is not None:
            lo = max(lo, pos // chunk * chunk)
        scores = torch.einsum("hd,lhd->hl", q[i].double(), k[lo : pos + 1]) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        if alibi_slopes is not None:
            scores = scores + alibi_slopes.double()[:, None] * (torch.arange(lo, pos + 1) - pos)[None, :]
        if sinks is not None:
            scores = torch.cat([scores, sinks.double()[:, None]], dim=1)
        weights = scores.softmax(-1)[:, : pos + 1 - lo]
        out[i] = torch.einsum("hl,lhd->hd", weights, v[lo : pos + 1])
    return out


def _run_paged(seqs, hq, hkv, head_dim, block_size, dtype, window=None, seed=0, **terms):
    """seqs: [(cached, new)]; returns (ours, naive) outputs for all new tokens (``terms``: softcap,
    alibi_slopes, sinks)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // block_size) for c, n in seqs]
    ids = list(range(sum(need) + 2))
    random.Random(seed).shuffle(ids)
    tables = [ids[sum(need[:i]) : sum(need[: i + 1])] for i in range(len(seqs))]
    k_cache = torch.zeros(len(ids), block_size, hkv, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    full = [
        (torch.randn(c + n, hkv, head_dim, generator=gen), torch.randn(c + n, hkv, head_dim, generator=gen))
        for c, n in seqs
    ]
    store = AttentionMetadata.build([0] * len(seqs), [c + n for c, n in seqs], tables, block_size)
    ops.store_kv_cache(
        torch.cat([k for k, _ in full]).to(dtype),
        torch.cat([v for _, v in full]).to(dtype),
        k_cache,
        v_cache,
        store.slot_mapping,
    )
    meta = AttentionMetadata.build([c for c, _ in seqs], [n for _, n in seqs], tables, block_size)
    q = torch.randn(meta.num_tokens, hq, head_dim, generator=gen)
    scale = head_dim**-0.5
    softcap = terms.pop("softcap", None)
    ours = ops.paged_attention(q.to(dtype), k_cache, v_cache, meta, scale, window, softcap, **terms)
    want, start = [], 0
    for (c, n), (k, v) in zip(seqs, full, strict=True):
        want.append(_naive_attention(q[start : start + n], k, v, c, scale, window, softcap, **terms))
        start += n
    return ours, torch.cat(want)


SCENARIOS = {
    "decode": [(0, 1), (4, 1), (15, 1), (6, 1), (33, 1)],
    "prefill": [(0, 1), (0, 7), (0, 16), (0, 21)],
    "chunked": [(5, 3), (12, 9), (16, 4)],
    "mixed": [(3, 1), (0, 5), (9, 1), (8, 4), (0, 1)],
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (16, 2)], ids=["gqa1", "gqa4", "gqa8"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_paged_attention_matches_naive(scenario, head_dim, heads, dtype):
    block_size = 4 if head_dim == 64 else 16
    ours, want = _run_paged(SCENARIOS[scenario], *heads, head_dim, block_size, dtype)
    assert ours.dtype == dtype and ours.shape == want.shape
    torch.testing.assert_close(ours.double(), want, atol=ATTN_TOL[dtype], rtol=ATTN_TOL[dtype])


@pytest.mark.parametrize("scenario", ["decode", "chunked", "mixed"])
def test_paged_attention_sliding_window(scenario):
    ours, want = _run_paged(SCENARIOS[scenario], 8, 2, 64, 4, torch.float32, window=5)
    torch.testing.assert_close(ours.double(), want, atol=1e-5, rtol=1e-5)


SCORE_TERMS = {
    "softcap": lambda hq: dict(softcap=1.5),
    "alibi": lambda hq: dict(alibi_slopes=2.0 ** -torch.arange(1, hq + 1, dtype=torch.float32)),
    "sinks": lambda hq: dict(sinks=torch.linspace(-2.0, 3.0, hq)),
    "all": lambda hq: dict(softcap=4.0, alibi_slopes=torch.linspace(0.05, 0.8, hq), sinks=torch.linspace(1.0, -1.0, hq)),
    "chunk": lambda hq: dict(chunk=6),  # contexts of 1-37 positions: queries in their first to seventh chunk
    "chunk-and-sinks": lambda hq: dict(chunk=4, sinks=torch.linspace(-2.0, 3.0, hq)),
}


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("terms", list(SCORE_TERMS))
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_paged_attention_score_terms(scenario, terms, window):
    """Each query head's own slope and sink land on its rows, in decode batches and in prefill chunks, over the
    grouped query rows (8 query heads on 2 KV heads)."""
    ours, want = _run_paged(SCENARIOS[scenario], 8, 2, 64, 4, torch.float32, window, **SCORE_TERMS[terms](8))
    torch.testing.assert_close(ours.double(), want, atol=1e-5, rtol=1e-5)


def test_attention_layer_narrower_values_are_padded_in_the_cache_and_cut_from_the_output():
    """v_head_dim < head_dim (DeepSeek's MLA): the output is the attention over the unpadded values."""
    from core_pytorch_backend.layers.attention import Attention

    layer = Attention(4, 2, 16, 0.25, ops, v_head_dim=8)
    layer.bind_kv_cache(torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 16))
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(6, 64, generator=gen), torch.randn(6, 32, generator=gen), torch.randn(6, 16, generator=gen)
    meta = AttentionMetadata.build([0], [6], [[2, 0]], 4)
    out = layer(q, k, v, meta)
    want = _naive_attention(q.view(6, 4, 16), k.view(6, 2, 16), v.view(6, 2, 8), 0, 0.25, None)
    assert out.shape == (6, 32)
    torch.testing.assert_close(out.double(), want.reshape(6, 32), atol=1e-5, rtol=1e-5)
    assert not layer.v_cache[..., 8:].any()


def test_context_length_one_is_identity_on_values():
    ours, want = _run_paged([(0, 1)], 4, 2, 64, 16, torch.float32)
    torch.testing.assert_close(ours.double(), want, atol=1e-6, rtol=1e-6)


def test_attention_metadata_build():
    meta = AttentionMetadata.build([0, 6], [5, 1], [[3, 1], [0, 2]], 4)
    assert meta.slot_mapping.tolist() == [12, 13, 14, 15, 4, 10]
    assert meta.query_start_loc.tolist() == [0, 5, 6] and meta.row_starts() == [0, 5]
    assert meta.seq_lens.tolist() == [5, 7] and meta.seq_lens_list == [5, 7]
    assert meta.block_tables.dtype == torch.int32 and meta.block_tables.tolist() == [[3, 1], [0, 2]]
    assert (meta.max_query_len, meta.max_seq_len, meta.is_decode) == (5, 7, False)
    assert meta.positions().tolist() == [0, 1, 2, 3, 4, 6]
    assert meta.last_token_indices().tolist() == [4, 5]
    assert AttentionMetadata.build([3, 0], [1, 1], [[0], [1]], 4).is_decode
    # a prompt's last token alone (its prefix cached) is a chunk, not a decode row; a generated token is one
    singleton = AttentionMetadata.build([3, 6, 0], [1, 1, 4], [[0], [1, 2], [3]], 4, prompt_lens=[2, 7, 4])
    assert singleton.prompt_singletons == {1} and not singleton.is_decode
    assert singleton.decode_sequences() == [0] and singleton.chunk_sequences() == [1, 2]
    ragged = AttentionMetadata.build([4, 0, 2], [1, 1, 1], [[5, 6], [3], [7]], 4)
    assert ragged.block_tables.tolist() == [[5, 6], [3, 0], [7, 0]]
    assert AttentionMetadata.build([], [], [], 4).block_tables.shape == (0, 1)
    with pytest.raises(ValueError, match="blocks"):
        AttentionMetadata.build([0], [5], [[0]], 4)
    assert math.isclose(meta.num_tokens, 6)


@pytest.mark.parametrize("heads", [1, 3, 4, 6, 8, 12, 16, 32, 71, 112])
def test_alibi_slopes_are_transformers_bit_for_bit(heads):
    """Powers of two and the odd-power rule for the other heads (Bloom's and Falcon's build_alibi_tensor)."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    from core_pytorch_backend.layers.alibi import alibi_slopes

    theirs = build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), heads, torch.float32).view(heads, 2)[:, 1]
    assert torch.equal(alibi_slopes(heads), theirs)
