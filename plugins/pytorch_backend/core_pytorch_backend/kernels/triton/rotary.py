"""Neox (rotate-half) rotary embedding of q and k in one launch, one program per token.

The cos/sin caches are [max_positions, D / 2] float32 tables that already carry any frequency scaling
(linear, Llama 3: layers/rotary.py folds it into the tables), so the kernel is the same for every rope
type. The rotation is computed in float32 and rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(x_ptr, out_ptr, token, tok_stride, head_stride, num_heads, half, cos, sin,
            BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    i = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < num_heads) & (i < half)
    src = x_ptr + token * tok_stride + h * head_stride + i
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + token * num_heads * 2 * half + h * 2 * half + i
    tl.store(dst, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + half, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cos_ptr, sin_ptr,
    q_tok_stride, q_head_stride, k_tok_stride, k_head_stride, cache_stride,
    num_q_heads, num_k_heads, half,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)[None, :]
    cos = tl.load(cos_ptr + pos * cache_stride + i, mask=i < half, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * cache_stride + i, mask=i < half, other=0.0).to(tl.float32)
    _rotate(q_ptr, q_out_ptr, token, q_tok_stride, q_head_stride, num_q_heads, half, cos, sin,
            BLOCK_HQ, BLOCK_HALF)
    _rotate(k_ptr, k_out_ptr, token, k_tok_stride, k_head_stride, num_k_heads, half, cos, sin,
            BLOCK_HK, BLOCK_HALF)


def _check(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
           sin_cache: torch.Tensor) -> None:
    if query.dim() != 3 or key.dim() != 3 or query.shape[0] != key.shape[0] or query.shape[2] != key.shape[2]:
        raise ValueError(f"query [T, Hq, D] and key [T, Hkv, D] expected, got {tuple(query.shape)} and "
                         f"{tuple(key.shape)}")
    if query.shape[2] % 2 or cos_cache.shape[-1] * 2 != query.shape[2] or sin_cache.shape != cos_cache.shape:
        raise ValueError(f"cos_cache / sin_cache must be [max_positions, {query.shape[2] // 2}], got "
                         f"{tuple(cos_cache.shape)} and {tuple(sin_cache.shape)}")
    if positions.shape != (query.shape[0],):
        raise ValueError(f"positions must be [{query.shape[0]}], got {tuple(positions.shape)}")


def apply_rotary(
    query: torch.Tensor,
    key: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox / rotate-half rotary embedding of q [T, Hq, D] and k [T, Hkv, D].

    ``cos_cache`` / ``sin_cache`` are [max_positions, D / 2] (float32); rotation uses the whole head.
    """
    _check(query, key, positions, cos_cache, sin_cache)
    if query.stride(-1) != 1 or key.stride(-1) != 1:
        query, key = query.contiguous(), key.contiguous()
    cos_cache, sin_cache = cos_cache.contiguous(), sin_cache.contiguous()
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    num_tokens, num_q_heads, head_dim = query.shape
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            query, key, q_out, k_out, positions, cos_cache, sin_cache,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos_cache.stride(0),
            num_q_heads, key.shape[1], head_dim // 2,
            BLOCK_HQ=triton.next_power_of_2(num_q_heads), BLOCK_HK=triton.next_power_of_2(key.shape[1]),
            BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        )
    return q_out, k_out
