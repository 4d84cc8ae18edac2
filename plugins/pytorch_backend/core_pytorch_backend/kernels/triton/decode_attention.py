"""Paged decode attention: one new token per sequence, grouped-query, split along the context.

Stage 1 runs one program per (sequence, KV head, split): it loads each K/V tile once for all the query
heads of its group (padded to 16 rows for ``tl.dot``), walks the tokens of its split through the block
table and keeps an online softmax. With one split it writes the output directly; with several it writes
a partial output and its log-sum-exp, and stage 2 merges the splits.

Every length is read on the device and the grid depends only on shapes (the batch, the heads and the
block-table width), so a launch needs no host sync and can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .common import LOG2E, attend_tile, cache_rows, dot_options

BLOCK_N = 32  # context tokens per tile
MIN_SPLIT_TOKENS = 256  # a split never covers fewer tokens of capacity than this
MAX_SPLITS = 32


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    q_tok_stride, q_head_stride, cache_block_stride, cache_slot_stride, cache_head_stride,
    table_stride, out_tok_stride, out_head_stride,
    qk_scale, block_size, window, group, head_dim, split_len,
    NUM_SPLITS: tl.constexpr, HAS_WINDOW: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    GROUP_PAD: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
        start = tl.maximum(start, lo - lo % BLOCK_N)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * group + g
    g_mask = g < group
    d_mask = d < head_dim
    q = tl.load(q_ptr + seq * q_tok_stride + heads[:, None] * q_head_stride + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    for tile in range(start, end, BLOCK_N):
        j = tile + tl.arange(0, BLOCK_N)
        j_mask = (j < end) & (j >= lo)
        rows = cache_rows(tables_ptr, seq * table_stride, j, j_mask, block_size, cache_block_stride,
                          cache_slot_stride, kv_head * cache_head_stride)
        kv_mask = j_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        m_i, l_i, acc = attend_tile(q, k, v, j_mask[None, :], m_i, l_i, acc, qk_scale, PRECISION)
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + seq * out_tok_stride + heads[:, None] * out_head_stride + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        num_heads = tl.num_programs(1) * group
        part = (seq * num_heads + heads) * NUM_SPLITS + split
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(part_out_ptr + part[:, None] * head_dim + d[None, :], out,
                 mask=g_mask[:, None] & d_mask[None, :])
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=g_mask)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, out_tok_stride, out_head_stride, head_dim,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = seq * tl.num_programs(1) + head
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, BLOCK_D)
    lse = tl.load(part_lse_ptr + row * NUM_SPLITS + s, mask=s < NUM_SPLITS, other=float("-inf"))
    top = tl.max(lse, axis=0)
    w = tl.where(lse > float("-inf"), tl.exp2(lse - top), 0.0)
    part = tl.load(part_out_ptr + (row * NUM_SPLITS + s[:, None]) * head_dim + d[None, :],
                   mask=(s[:, None] < NUM_SPLITS) & (d[None, :] < head_dim), other=0.0)
    total = tl.sum(w, axis=0)
    out = tl.sum(part * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * out_tok_stride + head * out_head_stride + d, out.to(out_ptr.dtype.element_ty),
             mask=d < head_dim)


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_num_splits(batch: int, num_kv_heads: int, capacity: int, device: torch.device) -> int:
    """Enough splits to give every SM about two programs, none shorter than MIN_SPLIT_TOKENS of capacity.

    ``capacity`` is the block-table width in tokens (fixed for a captured graph), never the actual
    lengths, so the choice needs no host sync.
    """
    wanted = triton.cdiv(2 * _sm_count(device), max(batch * num_kv_heads, 1))
    return max(1, min(wanted, triton.cdiv(capacity, MIN_SPLIT_TOKENS), MAX_SPLITS))


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Attention of query [B, Hq, D] (sequence b's one new token) over its first seq_lens[b] cached tokens."""
    batch, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({num_kv_heads})")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share one layout with a contiguous head dimension")
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if batch == 0:
        return out
    capacity = block_tables.shape[1] * block_size
    splits = num_splits or default_num_splits(batch, num_kv_heads, capacity, query.device)
    split_len = triton.cdiv(triton.cdiv(capacity, splits), BLOCK_N) * BLOCK_N
    group = num_heads // num_kv_heads
    block_d = max(triton.next_power_of_2(head_dim), 16)
    parts = torch.empty((batch, num_heads, splits, head_dim) if splits > 1 else (1,), dtype=torch.float32,
                        device=query.device)
    lse = torch.empty((batch, num_heads, splits) if splits > 1 else (1,), dtype=torch.float32,
                      device=query.device)
    _decode_split_kernel[(batch, num_kv_heads, splits)](
        query, k_cache, v_cache, block_tables, seq_lens, out, parts, lse,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        scale * LOG2E, block_size, sliding_window or 0, group, head_dim, split_len,
        NUM_SPLITS=splits, HAS_WINDOW=sliding_window is not None, **dot_options(query.dtype),
        GROUP_PAD=max(triton.next_power_of_2(group), 16), BLOCK_D=block_d, BLOCK_N=BLOCK_N,
    )
    if splits > 1:
        _merge_splits_kernel[(batch, num_heads)](
            parts, lse, out, out.stride(0), out.stride(1), head_dim,
            NUM_SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits), BLOCK_D=block_d,
        )
    return out
