"""Prefill / extend attention over the paged KV cache: causal, variable lengths, cached prefixes.

Sequence b brings the last ``q_len`` of its ``seq_len`` tokens (``q_len`` from ``query_start_loc``,
the rest is a cached prefix: prefix caching or an earlier chunk); every key, the new ones included, is
read from the cache through the block table (the new K/V are stored before attention runs). One
program per (query tile, sequence, query head) runs a flash-attention loop up to the causal bound of its
tile. Decode rows (``q_len`` 1) are handled too, so a mixed batch needs one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import LOG2E, attend_tile, cache_rows, dot_options


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, tables_ptr, seq_lens_ptr, query_start_ptr,
    q_tok_stride, q_head_stride, cache_block_stride, cache_slot_stride, cache_head_stride,
    table_stride, out_tok_stride, out_head_stride,
    qk_scale, block_size, window, group, head_dim,
    HAS_WINDOW: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    pos = seq_len - q_len + i
    d = tl.arange(0, BLOCK_D)
    q_mask = (i < q_len)[:, None] & (d < head_dim)[None, :]
    q_rows = (q_start + i).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * q_tok_stride + head * q_head_stride + d[None, :], mask=q_mask,
                other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    kv_head = head // group
    hi = tl.minimum(seq_len, seq_len - q_len + (tile + 1) * BLOCK_M)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - q_len + tile * BLOCK_M - window + 1, 0)
        lo = lo - lo % BLOCK_N
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_mask = j < seq_len
        rows = cache_rows(tables_ptr, seq * table_stride, j, j_mask, block_size, cache_block_stride,
                          cache_slot_stride, kv_head * cache_head_stride)
        kv_mask = j_mask[:, None] & (d < head_dim)[None, :]
        k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        valid = j_mask[None, :] & (j[None, :] <= pos[:, None])
        if HAS_WINDOW:
            valid = valid & (j[None, :] > pos[:, None] - window)
        m_i, l_i, acc = attend_tile(q, k, v, valid, m_i, l_i, acc, qk_scale, PRECISION)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * out_tok_stride + head * out_head_stride + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


def _tiles(max_query_len: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): query tiles no taller than the longest chunk, 64 x 64 at most (32 keys at D > 64)."""
    block_m = min(64, max(16, triton.next_power_of_2(max_query_len)))
    return block_m, 64 if head_dim <= 64 else 32


def prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of the flat new tokens query [T, Hq, D] over each sequence's cached context."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share one layout with a contiguous head dimension")
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    batch = seq_lens.shape[0]
    if num_tokens == 0 or batch == 0:
        return out
    block_m, block_n = _tiles(max_query_len, head_dim)
    _prefill_kernel[(triton.cdiv(max_query_len, block_m), batch, num_heads)](
        query, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        scale * LOG2E, k_cache.shape[1], sliding_window or 0, num_heads // num_kv_heads, head_dim,
        HAS_WINDOW=sliding_window is not None, **dot_options(query.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(triton.next_power_of_2(head_dim), 16),
    )
    return out
