"""A weight kept as 4- or 8-bit codes in the native kernel's layout (``csrc/packed_linear.c``).

``NativeWeight.from_affine`` lays out an ``AffineWeight`` (codes per group of 32 inputs with one scale
and offset each): K is padded to a multiple of 64 with zero groups; 4-bit codes of groups 2p and 2p+1
share the bytes of pair p (low and high nibble); a symmetric offset (``o = -2^(bits-1) * s``: GGUF
Q4_0 and Q8_0, int8) is kept as a zero point instead of an array. ``linear`` takes float32 or bfloat16
activations and returns the same dtype.
"""

from __future__ import annotations

import numpy as np
import torch

from ..layers.quantized import PackedWeight
from ..quant.affine import AffineWeight
from .library import CpuKernels

GROUP, PAIR = 32, 64
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # csrc DT_*


def native_fits(weight: AffineWeight) -> bool:
    """Whether the native kernel takes ``weight`` (groups of 32 inputs, codes of up to 8 bits)."""
    return weight.group_size == GROUP and weight.bits <= 8


def _padded(array: np.ndarray, columns: int) -> np.ndarray:
    out = np.zeros((array.shape[0], columns), dtype=array.dtype)
    out[:, : array.shape[1]] = array
    return out


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """uint8 codes [N, Kp] (< 16) -> [N, Kp / 2]: pair p's byte j = code(64p + j) | code(64p + 32 + j) << 4."""
    n, kp = codes.shape
    pairs = codes.reshape(n, kp // PAIR, 2, GROUP)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, kp // 2)


class NativeWeight(PackedWeight):
    """A [N, K] weight multiplied by the native CPU kernel (see the module docstring)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, zero_point: float,
                 bits: int, shape: tuple[int, int], kernels: CpuKernels) -> None:
        super().__init__(shape)
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)
        self.register_buffer("offset", offset)
        self.zero_point = zero_point
        self.bits = bits
        self.padded_k = scale.shape[1] * GROUP
        self.kernels = kernels

    @classmethod
    def from_affine(cls, weight: AffineWeight, kernels: CpuKernels) -> NativeWeight:
        if not native_fits(weight):
            raise ValueError(f"a {weight.bits}-bit weight with groups of {weight.group_size} does not fit "
                             "the native kernel (groups of 32, up to 8 bits)")
        n, k = weight.shape
        kp = -(-k // PAIR) * PAIR
        bits = 4 if weight.bits <= 4 else 8
        codes = _padded(weight.q, kp)
        codes = _pack_nibbles(codes) if bits == 4 else codes
        scale = _padded(weight.scale.astype(np.float32), kp // GROUP)
        zero_point = float(2 ** (weight.bits - 1))
        symmetric = np.array_equal(weight.offset, (-zero_point * weight.scale).astype(weight.offset.dtype))
        offset = None if symmetric else torch.from_numpy(_padded(weight.offset.astype(np.float32), kp // GROUP))
        return cls(torch.from_numpy(np.ascontiguousarray(codes)), torch.from_numpy(scale), offset,
                   zero_point if symmetric else 0.0, bits, (n, k), kernels)

    @property
    def kind(self) -> str:
        """What the start-up line calls this layer's weights."""
        return f"int{self.bits}-native"

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None, *, reference: bool = False) -> torch.Tensor:
        n, k = self.shape
        flat = x.reshape(-1, k)
        out = self.dense_linear(flat, bias)
        if out is not None:
            return out.view(*x.shape[:-1], n).to(x.dtype)
        code = DTYPE_CODES.get(flat.dtype)
        if code is None:
            flat, code = flat.float(), 0
        flat = flat.contiguous()
        out = torch.empty(flat.shape[0], n, dtype=flat.dtype)
        bias = None if bias is None else bias.to(torch.float32).contiguous()  # named: alive during the call
        self.kernels.call(
            "core_packed_linear_reference" if reference else "core_packed_linear", flat.data_ptr(), code,
            flat.shape[0], k, self.codes.data_ptr(), self.bits, n, self.padded_k, self.scale.data_ptr(),
            None if self.offset is None else self.offset.data_ptr(), self.zero_point,
            None if bias is None else bias.data_ptr(), out.data_ptr(), code)
        return out.view(*x.shape[:-1], n).to(x.dtype)

    def extra_repr(self) -> str:
        offsets = "offsets" if self.offset is not None else f"zero point {self.zero_point:g}"
        return (f"shape={self.shape}, bits={self.bits}, groups of {GROUP}, {offsets}, {self.kernels.variant}"
                f"{self.dense_repr()}")
