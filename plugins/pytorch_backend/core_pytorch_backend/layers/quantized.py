"""Weights kept quantized in memory and multiplied by torch's weight-only CPU kernels.

- ``Int4Weight``: ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (4-bit codes, one scale and zero per
  32 inputs: ``w = (q - 8) * s + z``). Codes of up to 8 bits (GGUF Q8_0) are split into a low and a high
  4-bit plane laid side by side along K, and the input is repeated to match: ``x @ [lo | hi]^T`` with
  the high plane's scale 16x is the exact 8-bit product, in one kernel call at the same bytes per weight.
- ``AffineRows``: an embedding table kept as codes; a lookup dequantizes only the rows it reads.

The kernel takes bfloat16, float16 or float32 activations with scales of the same dtype. On this
project's AVX-512 CPUs bfloat16 is the fast one (float32 and float16 are 40x slower): see
``quant.kernel_choice``, which times it once per CPU where this kernel serves (where the native
kernels cannot be built). (torch's per-channel int8 kernel,
``_weight_int8pack_mm``, is faster at one row but per-channel codes lose too much: 8-bit codes per group
of 32 as two planes agree with the float model far better.)
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..quant.affine import AffineWeight

INT4_GROUP_SIZES = (32, 64, 128, 256)  # what the CPU int4 kernel accepts
ROW_MULTIPLE = 16  # the int4 packing wants N divisible by 16
DENSE_MIN_ROWS = 6  # with a dense copy, steps of this many rows use it (break-even at 4-6 rows here)
PACK_ROWS = 4096  # rows packed at a time (bounds the int32 staging copy); a multiple of 64
INT4_MM = torch.ops.aten._weight_int4pack_mm_for_cpu.default  # the overload itself: no per-call resolution


def int4_fits(n: int, k: int, group_size: int = 32) -> bool:
    """Whether an [n, k] weight in groups of ``group_size`` inputs fits the CPU int4 kernel."""
    return group_size in INT4_GROUP_SIZES and k % group_size == 0 and n % ROW_MULTIPLE == 0


def int4_packable(weight: AffineWeight) -> bool:
    """Whether ``weight`` fits the CPU int4 kernel (shape, group size, one or two 4-bit planes)."""
    return weight.bits <= 8 and int4_fits(*weight.shape, weight.group_size)


class Int4Weight(nn.Module):
    """A [N, K] weight packed for the CPU int4 kernel (one or two 4-bit planes), which may also keep a
    dense copy for steps of many rows."""

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, group_size: int, shape: tuple[int, int],
                 planes: int) -> None:
        super().__init__()
        self.shape = shape
        self.register_buffer("dense", None)  # see keep_dense_copy
        self.dense_min_rows = 0
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", scales_zeros)  # [planes * K / G, N, 2] in the activation dtype
        self.group_size = group_size
        self.planes = planes

    @classmethod
    def from_affine(cls, weight: AffineWeight, dtype: torch.dtype) -> Int4Weight:
        if not int4_packable(weight):
            raise ValueError(f"a {weight.bits}-bit weight {weight.shape} with groups of {weight.group_size} "
                             "does not fit the int4 kernel")
        planes = _planes(weight)
        codes = np.concatenate([q for q, _, _ in planes], axis=1)  # [N, planes * K]
        scale = np.concatenate([s for _, s, _ in planes], axis=1)
        zero = np.concatenate([z for _, _, z in planes], axis=1)
        scales_zeros = torch.from_numpy(np.stack((scale.T, zero.T), axis=-1)).to(dtype).contiguous()
        return cls(_pack_int4(codes), scales_zeros, weight.group_size, weight.shape, len(planes))

    @property
    def kind(self) -> str:
        """What the start-up line calls this layer's weights (8-bit codes are two 4-bit planes)."""
        return "int4" if self.planes == 1 else "int8"

    def keep_dense_copy(self, weight: AffineWeight, dtype: torch.dtype, min_rows: int = DENSE_MIN_ROWS) -> None:
        """Also keep ``weight`` dense in ``dtype``, for steps of ``min_rows`` rows or more: at many rows a
        dense half-precision GEMM beats the packed kernels (the LM head's two planes at 64 rows: 21.8 ms
        vs 4.9 ms here), at the cost of the dense copy's memory."""
        self.dense = torch.from_numpy(weight.dequantize()).to(dtype)
        self.dense_min_rows = min_rows

    def dense_linear(self, flat: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """``flat [M, K] @ W^T (+ bias)`` through the dense copy when there is one and M is large enough,
        in the copy's dtype; else None (the packed kernel's turn)."""
        dense = self._buffers["dense"]  # read once: an nn.Module attribute lookup is a slow __getattr__
        if dense is None or flat.shape[0] < self.dense_min_rows:
            return None
        if flat.dtype != dense.dtype:
            flat = flat.to(dense.dtype)
        return F.linear(flat, dense, None if bias is None else bias.to(flat.dtype))

    def dense_repr(self) -> str:
        return f", dense copy from {self.dense_min_rows} rows" if self.dense is not None else ""

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # A decode step calls this ~120 times: buffers are read from _buffers (an nn.Module attribute
        # lookup is a slow __getattr__), and no op runs that the call does not need.
        flat = x.reshape(-1, self.shape[1])
        out = self.dense_linear(flat, bias)
        if out is None:
            scales_zeros = self._buffers["scales_zeros"]
            if flat.dtype != scales_zeros.dtype:
                flat = flat.to(scales_zeros.dtype)
            if self.planes == 2:
                flat = torch.cat((flat, flat), dim=-1)
            elif not flat.is_contiguous():
                flat = flat.contiguous()
            out = INT4_MM(flat, self._buffers["packed"], self.group_size, scales_zeros)
            if bias is not None:
                out = out + bias.to(out.dtype)
        if out.dtype != x.dtype:
            out = out.to(x.dtype)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.shape[0])

    def extra_repr(self) -> str:
        return f"shape={self.shape}, group_size={self.group_size}, planes={self.planes}{self.dense_repr()}"


def _planes(weight: AffineWeight) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(codes 0..15, kernel scale, kernel zero) per 4-bit plane, so that sum of (code - 8) * s + z
    over the planes equals ``q * scale + offset``.

    Two planes: ``q * s + b = 16 s (high - 8) + s (low - 8) + (b + 136 s)``. The high plane is centred
    (no zero term), so the kernel's half-precision scales and zeros carry no large terms that cancel:
    a symmetric 8-bit code (``b = -128 s``) leaves the low plane a zero of ``8 s``.
    """
    s, b = weight.scale, weight.offset
    if weight.bits <= 4:
        return [(weight.q, s, b + 8 * s)]
    low, high = weight.q & 0x0F, weight.q >> 4
    return [(low, s, b + 136 * s), (high, 16 * s, np.zeros_like(s))]


def _pack_int4(codes: np.ndarray) -> torch.Tensor:
    """Codes uint8 [N, K] -> the kernel's packed layout, a few thousand rows at a time."""
    parts = []
    for start in range(0, codes.shape[0], PACK_ROWS):
        chunk = torch.from_numpy(np.ascontiguousarray(codes[start : start + PACK_ROWS])).to(torch.int32)
        parts.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(chunk, 1))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def packed_linear(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """The ``matmul`` of a layer whose weight is packed (same signature as ``F.linear``)."""
    return weight.linear(x, bias)


class AffineRows(nn.Module):
    """An embedding table kept as ``AffineWeight`` codes; ``lookup`` dequantizes the rows it reads."""

    def __init__(self, weight: AffineWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("q", torch.from_numpy(np.ascontiguousarray(weight.q)))
        self.register_buffer("scale", torch.from_numpy(np.ascontiguousarray(weight.scale)))
        self.register_buffer("offset", torch.from_numpy(np.ascontiguousarray(weight.offset)))
        self.group_size = weight.group_size
        self.dtype = dtype
        self.shape = weight.shape

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        q = self.q.index_select(0, flat).view(flat.numel(), -1, self.group_size).float()
        rows = q * self.scale.index_select(0, flat)[..., None] + self.offset.index_select(0, flat)[..., None]
        return rows.view(*ids.shape, self.shape[1]).to(self.dtype)


def affine_embedding(ids: torch.Tensor, weight: AffineRows) -> torch.Tensor:
    """The ``lookup`` of an embedding whose table is ``AffineRows`` (same signature as ``F.embedding``)."""
    return weight.lookup(ids)
