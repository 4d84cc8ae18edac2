"""Group-wise affine quantized weights: the one form every packed weight passes through.

``w[n, k] = q[n, k] * scale[n, k // G] + offset[n, k // G]`` with integer codes ``q`` in ``[0, 2**bits)``.
GGUF's block formats (``gguf_blocks``) and core's own load-time quantization (``quantize_int4``) produce
it; the packed kernels (``layers.quantized``) consume it. Pure numpy, so it is testable without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CHUNK_VALUES = 1 << 20  # quantize_int8's values at a time
SUPER_BLOCK = 256  # the inputs of one of ``AffineWeight.units``' values (GGUF's K-quant super-blocks)


@dataclass
class AffineWeight:
    """``q`` uint8 [N, K]; ``scale`` / ``offset`` float32 [N, K // group_size]. ``units``: where every scale
    (offset) is a whole multiple, within int8's range, of one value per ``SUPER_BLOCK`` inputs of its row (GGUF's
    K-quants: ``d * sc`` under the super-block's ``d``), those values (scale unit, offset unit) float32
    [N, K // SUPER_BLOCK]; the native kernel then keeps the scales as int8 codes (native/packed_weight.py)."""

    q: np.ndarray
    scale: np.ndarray
    offset: np.ndarray
    bits: int
    group_size: int
    units: tuple[np.ndarray, np.ndarray] | None = None

    def __post_init__(self) -> None:
        n, k = self.q.shape
        if k % self.group_size:
            raise ValueError(f"K={k} is not a multiple of the group size {self.group_size}")
        groups = (n, k // self.group_size)
        if self.scale.shape != groups or self.offset.shape != groups:
            raise ValueError(f"scale/offset must be {groups}, got {self.scale.shape} / {self.offset.shape}")
        if not 1 <= self.bits <= 8:
            raise ValueError(f"bits must be 1..8, got {self.bits}")
        if self.units is not None and (k % SUPER_BLOCK or any(u.shape != (n, k // SUPER_BLOCK) for u in self.units)):
            raise ValueError(f"units must be [N, K / {SUPER_BLOCK}] = {(n, k // SUPER_BLOCK)}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> np.ndarray:
        """float32 [N, K]: the weight this quantization stands for."""
        n, k = self.q.shape
        g = self.group_size
        q = self.q.reshape(n, k // g, g).astype(np.float32)
        return (q * self.scale[..., None] + self.offset[..., None]).reshape(n, k)

    def rows(self, index: np.ndarray) -> AffineWeight:
        """The weight with its output rows reordered (or selected) by ``index``."""
        units = None if self.units is None else (self.units[0][index], self.units[1][index])
        return AffineWeight(self.q[index], self.scale[index], self.offset[index], self.bits, self.group_size, units)

    def in_groups_of(self, group_size: int) -> AffineWeight:
        """The same weight with a scale and offset per ``group_size`` inputs (a divisor of this one's)."""
        if self.group_size % group_size:
            raise ValueError(f"groups of {self.group_size} cannot be cut into groups of {group_size}")
        times = self.group_size // group_size
        return AffineWeight(self.q, np.repeat(self.scale, times, axis=1), np.repeat(self.offset, times, axis=1),
                            self.bits, group_size, self.units)  # the same multiples of the same units

    @staticmethod
    def concat(parts: list[AffineWeight]) -> AffineWeight:
        """Stack along the output rows (fused q/k/v or gate/up projections); parts of different group sizes
        are stacked in the smallest (Q5_0 q/k next to a Q6_K v: groups of 16)."""
        smallest = min(p.group_size for p in parts)
        if any(p.group_size % smallest for p in parts):
            raise ValueError("weights whose group sizes do not divide one another cannot be stacked")
        parts = [p if p.group_size == smallest else p.in_groups_of(smallest) for p in parts]
        first = parts[0]
        if any(p.shape[1] != first.shape[1] for p in parts):
            raise ValueError("only weights of the same K can be stacked")
        bits = max(p.bits for p in parts)  # a code of fewer bits is also a valid code of more
        units = None
        if all(p.units is not None for p in parts):
            units = tuple(np.concatenate([p.units[i] for p in parts]) for i in (0, 1))
        return AffineWeight(np.concatenate([p.q for p in parts]), np.concatenate([p.scale for p in parts]),
                            np.concatenate([p.offset for p in parts]), bits, first.group_size, units)


def _min_max_codes(w: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes, scale, offset) of groups ``w [..., G]`` on ``levels`` steps from their min to their max."""
    low, high = w.min(-1), w.max(-1)
    scale = (high - low) / (levels - 1)
    inverse = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)
    q = np.clip(np.rint((w - low[..., None]) * inverse[..., None]), 0, levels - 1).astype(np.uint8)
    return q, scale, low


def quantize_int4(weight: np.ndarray, group_size: int = 32) -> AffineWeight:
    """Asymmetric 4-bit codes per group of ``group_size`` inputs (min/max, as GGUF's Q4_1)."""
    n, k = weight.shape
    q, scale, low = _min_max_codes(weight.astype(np.float32).reshape(n, k // group_size, group_size), 16)
    return AffineWeight(q.reshape(n, k), scale, low, 4, group_size)


def quantize_int8(weight: np.ndarray, group_size: int = 32) -> AffineWeight:
    """8-bit codes per group of ``group_size`` inputs: each group the closer (least squared error) of
    symmetric codes (absmax / 127, GGUF's Q8_0) and min/max codes (255 steps from min to max).

    Min/max codes have the finer step whenever a group's values are not centred on zero; symmetric ones
    keep zero exact. The kernels take any offset per group, so the choice costs nothing at run time.
    A few rows at a time (``CHUNK_VALUES``), so that the temporaries stay in cache: 12 instead of 31 ns a
    value for a 4096 x 4096 weight on a Zen 4 EPYC.
    """
    n, k = weight.shape
    rows = max(1, CHUNK_VALUES // max(k, 1))
    q = np.empty((n, k), dtype=np.uint8)
    scale, offset = np.empty((n, k // group_size), np.float32), np.empty((n, k // group_size), np.float32)
    for start in range(0, n, rows):
        end = min(n, start + rows)
        chunk = weight[start:end].astype(np.float32).reshape(end - start, k // group_size, group_size)
        codes, scale[start:end], offset[start:end] = _int8_codes(chunk)
        q[start:end] = codes.reshape(end - start, k)
    return AffineWeight(q, scale, offset, 8, group_size)


def _int8_codes(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """quantize_int8's (codes, scale, offset) of groups ``w [..., G]``."""
    scale = np.abs(w).max(-1) / 127
    inverse = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)
    q = (np.clip(np.rint(w * inverse[..., None]), -127, 127) + 128).astype(np.uint8)
    offset = -128 * scale
    q_mm, scale_mm, offset_mm = _min_max_codes(w, 256)
    error = ((q * scale[..., None] + offset[..., None] - w) ** 2).sum(-1)
    error_mm = ((q_mm * scale_mm[..., None] + offset_mm[..., None] - w) ** 2).sum(-1)
    closer = error_mm < error
    return np.where(closer[..., None], q_mm, q), np.where(closer, scale_mm, scale), np.where(closer, offset_mm, offset)
