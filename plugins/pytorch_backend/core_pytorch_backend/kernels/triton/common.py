"""What the kernels share: the paged-cache gather, one flash-attention step, the interpreter switch.

Triton 3.9's interpreter (``TRITON_INTERPRET=1``, the CPU test path) has two bfloat16 quirks: ``tl.dot``
multiplies the raw 16-bit patterns of bfloat16 operands, and float32 -> bfloat16 casts truncate instead of
rounding to nearest. The attention kernels therefore feed ``tl.dot`` float32 operands when interpreting
(``dot_options``); compiled on a GPU they use the cache dtype. The truncation only costs the tests one
bfloat16 ulp of tolerance.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # softmax runs in base 2: exp(x) = exp2(x * log2(e))


def interpreting() -> bool:
    """True when triton runs kernels in its CPU interpreter."""
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


def dot_options(dtype: torch.dtype) -> dict[str, object]:
    """The attention kernels' ``UPCAST`` / ``PRECISION`` constexprs for a query dtype.

    ``UPCAST``: feed ``tl.dot`` float32 operands (the interpreter with a 16-bit dtype, see above).
    ``PRECISION``: exact float32 products for float32 models (the reference's precision, not TF32); for
    16-bit operands the setting does not apply and stays triton's default.
    """
    return {"UPCAST": interpreting() and dtype != torch.float32,
            "PRECISION": "ieee" if dtype == torch.float32 else "tf32"}


@triton.jit
def cache_rows(tables_ptr, table_row, j, j_mask, block_size, block_stride, slot_stride, head_offset):
    """Element offsets of context tokens ``j`` of one sequence (``table_row``: where its block-table row
    starts) in a ``[num_blocks, block_size, heads, D]`` cache, at one head."""
    block = tl.load(tables_ptr + table_row + j // block_size, mask=j_mask, other=0).to(tl.int64)
    return block * block_stride + (j % block_size) * slot_stride + head_offset


@triton.jit
def attend_tile(q, k, v, valid, m_i, l_i, acc, qk_scale, PRECISION: tl.constexpr):
    """One key tile of flash attention (base 2): q [M, D] against k, v [N, D] where ``valid`` [M, N],
    folded into the running row max ``m_i``, sum ``l_i`` and output ``acc``; rows without a valid key so
    far stay at zero. ``qk_scale`` includes log2(e)."""
    s = tl.where(valid, tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc
