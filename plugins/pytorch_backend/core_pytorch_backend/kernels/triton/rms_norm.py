"""RMSNorm over the last dimension, optionally fused with the residual add that precedes it.

Rounding follows the reference exactly: the sum ``x + residual`` is rounded to the input dtype (it is
the new residual), normalised in float32, rounded to the input dtype, then scaled by the weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    x_row_stride, residual_row_stride, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * residual_row_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * hidden + cols, x, mask=mask)
    h = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / hidden + eps)
    h = (h * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, (w * h).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm in float32 as HF Llama; with ``residual``, returns ``(norm(x + residual), x + residual)``."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight must have shape ({hidden},), got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    rows = _rows(x)
    res_rows = _rows(residual) if residual is not None else rows
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res_out = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else out
    if rows.shape[0]:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, res_rows, weight, out, res_out, rows.stride(0), res_rows.stride(0), hidden, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(max(block // 256, 1), 16),
        )
    return out if residual is None else (out, res_out)
