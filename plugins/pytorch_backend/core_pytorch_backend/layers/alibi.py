"""ALiBi's per-head slopes (Press et al., "Train Short, Test Long"), as Bloom's and Falcon's ``build_alibi_tensor``
compute them: for the largest power of two n <= heads, ``b ** i`` for i = 1..n with ``b = 2 ** (-8 / n)``; the
remaining heads take the odd powers of ``2 ** (-4 / n)``. The attention layer adds ``slope * (j - i)`` to each
score (``Attention(alibi_slopes=...)``)."""

from __future__ import annotations

import math

import torch


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """[num_heads] float32 slopes, bit for bit transformers' (float32 powers of a float32 base)."""
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = _powers(2 ** (-(2 ** -(math.log2(closest) - 3))), torch.arange(1, 1 + closest, dtype=torch.int32))
    if closest == num_heads:
        return slopes
    remaining = min(closest, num_heads - closest)
    extra = _powers(2 ** (-(2 ** -(math.log2(2 * closest) - 3))), torch.arange(1, 1 + 2 * remaining, 2, dtype=torch.int32))
    return torch.cat([slopes, extra])


def _powers(base: float, exponents: torch.Tensor) -> torch.Tensor:
    return torch.pow(torch.full((), base, dtype=torch.float32), exponents)
