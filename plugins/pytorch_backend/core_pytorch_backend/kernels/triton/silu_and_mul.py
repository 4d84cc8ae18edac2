"""SiLU-and-multiply of a merged [gate | up] projection: ``silu(gate) * up``.

Rounding follows the reference (silu rounded to the input dtype, then the product rounded).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_row_stride, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_row_stride + width + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * width + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for x = [gate | up] along the last dimension."""
    if x.shape[-1] % 2:
        raise ValueError(f"the last dimension of x must be even ([gate | up]), got {x.shape[-1]}")
    width = x.shape[-1] // 2
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((*x.shape[:-1], width), dtype=x.dtype, device=x.device)
    if rows.shape[0] and width:
        block = min(BLOCK, triton.next_power_of_2(width))
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(width, block))](
            rows, out, rows.stride(0), width, BLOCK=block
        )
    return out
