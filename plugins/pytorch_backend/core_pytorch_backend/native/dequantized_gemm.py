"""Steps of many rows through a packed 4-bit weight: dequantize a block of output rows at a time into a
small reused scratch buffer and multiply it with a dense GEMM.

torch's int4 CPU kernel is fast at a few rows and slow at many (SmolLM2's 1536x576 MLP weight at 64
rows: 326 us, where a dense bf16 GEMM takes 138 us); keeping a dense copy of every layer would cost the
memory the packed weights save. ``DequantizedGemm`` keeps the codes a second time in a plain layout
(half a byte per weight; the scales stay in the int4 kernel's table) and, for a step of ``min_rows``
rows or more, has ``core_dequantize_int4`` write each block of rows (a few MiB: it stays in cache for
the GEMM that reads it) and ``F.linear`` multiply it. The scratch buffer is one per thread, shared by
every layer that thread runs.
"""

from __future__ import annotations

import threading

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .library import CpuKernels
from .packed_weight import DTYPE_CODES

MIN_ROWS = 32  # below it torch's int4 kernel is as fast or faster (break-even at 16-32 rows on the Zen 5 EPYC)
SCRATCH_ELEMENTS = 1 << 21  # 4 MiB of bfloat16 per block of rows
_scratch = threading.local()


def _buffer(elements: int, dtype: torch.dtype) -> torch.Tensor:
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.dtype != dtype or buffer.numel() < elements:
        buffer = _scratch.buffer = torch.empty(max(elements, SCRATCH_ELEMENTS), dtype=dtype)
    return buffer


def dequantizable(codes: np.ndarray, group_size: int) -> bool:
    """Whether ``DequantizedGemm`` takes these codes: 4-bit, in an even number of groups per row."""
    return codes.shape[1] % (2 * group_size) == 0 and int(codes.max(initial=0)) <= 15


class DequantizedGemm(nn.Module):
    """4-bit codes [N, K] (two to a byte) for dense GEMMs over dequantized blocks of rows."""

    def __init__(self, codes: np.ndarray, group_size: int, dtype: torch.dtype, kernels: CpuKernels,
                 min_rows: int = MIN_ROWS) -> None:
        super().__init__()
        n, k = codes.shape
        if not dequantizable(codes, group_size):
            raise ValueError(f"codes must be 4-bit, in an even number of groups of {group_size} (K = {k})")
        pairs = codes.reshape(n, k // (2 * group_size), 2, group_size)  # the low nibble: the pair's first group
        self.register_buffer("codes", torch.from_numpy(np.ascontiguousarray(pairs[:, :, 0] | (pairs[:, :, 1] << 4))
                                                       .reshape(n, k // 2)))
        self.shape = (n, k)
        self.group_size = group_size
        self.dtype = dtype  # of the dense blocks and the GEMM
        self.kernels = kernels
        self.min_rows = min_rows

    def linear(self, x: torch.Tensor, scales_zeros: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W^T (+ bias)`` in ``self.dtype``, W given by the codes and the int4 kernel's table."""
        n, k = self.shape
        flat = x.reshape(-1, k).to(self.dtype)
        step = max(1, SCRATCH_ELEMENTS // k)  # output rows per block
        scratch = _buffer(min(n, step) * k, self.dtype)
        codes, sz_code, out_code = self.codes.data_ptr(), DTYPE_CODES[scales_zeros.dtype], DTYPE_CODES[self.dtype]
        pieces = []
        for start in range(0, n, step):
            end = min(n, start + step)
            block = scratch[: (end - start) * k].view(end - start, k)
            self.kernels.call("core_dequantize_int4", codes, start, end, n, k, scales_zeros.data_ptr(), sz_code,
                              self.group_size, block.data_ptr(), out_code)
            pieces.append(F.linear(flat, block))  # before the next block overwrites the scratch
        out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)
        return out if bias is None else out + bias.to(out.dtype)

    def extra_repr(self) -> str:
        return f"shape={self.shape}, dense {str(self.dtype).removeprefix('torch.')} blocks from {self.min_rows} rows"
