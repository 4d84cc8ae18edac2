"""Rotary in pairs of adjacent values (GLM's layout, which Helium and ERNIE 4.5 take): value 2i of a head turns
with value 2i + 1 at frequency i, where ``layers.rotary`` turns value i with value i + d/2 (rotate-half). The
two agree once each head's q and k projection rows (and biases) are put in the order 0, 2, 4, ..., 1, 3, 5,
...: one permutation at load, the same for q and k, so their dot products, and attention, are unchanged, and
the layers stay ``models.llama``'s (the native decode stack serves them)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from ..native.half_weights import HalfWeight
from ..quant.affine import AffineWeight
from .llama import head_dim_of

Weight = torch.Tensor | AffineWeight | HalfWeight


def rotate_half_order(head_dim: int, rotary_dim: int) -> np.ndarray:
    """Within a head: the even values of the rotated part, then its odd ones, then the values left unrotated."""
    return np.concatenate([np.arange(0, rotary_dim, 2), np.arange(1, rotary_dim, 2), np.arange(rotary_dim, head_dim)])


def rows_reordered(tensor: Weight, order: np.ndarray, name: str) -> Weight:
    """``tensor``'s rows (a bias's values) in ``order``, whichever form the checkpoint gave it in."""
    if isinstance(tensor, AffineWeight):
        return tensor.rows(order)
    if isinstance(tensor, HalfWeight):
        return HalfWeight(tensor.values[torch.from_numpy(order)])
    if tensor.shape[0] != len(order):
        raise ValueError(f"{name}: {tensor.shape[0]} rows for a q/k projection of {len(order)}")
    return tensor[torch.from_numpy(order)]


def halves_swapped_order(head_dim: int) -> np.ndarray:
    """Within a head: its second half, then its first. NanoChat's rotary turns the other way (``rotate_half`` as
    ``cat(x2, -x1)``), which is rotate-half's turn of the halves swapped, swapped back; q and k swapped alike
    leave their dot products, and the weightless norms NanoChat takes of them after rotary, unchanged."""
    return np.roll(np.arange(head_dim), head_dim // 2)


def pairs_to_rotate_half(weights: Iterable[tuple[str, Weight]], config: Any, rotary_dim: int | None = None
                         ) -> Iterator[tuple[str, Weight]]:
    """The checkpoint's tensors with every q and k projection's rows (and biases) in rotate-half order."""
    head_dim = head_dim_of(config)
    return q_k_rows_reordered(weights, config, rotate_half_order(head_dim, rotary_dim or head_dim))


def q_k_rows_reordered(weights: Iterable[tuple[str, Weight]], config: Any, within: np.ndarray
                       ) -> Iterator[tuple[str, Weight]]:
    """The checkpoint's tensors with each head's q and k projection rows (and biases) in the order ``within``."""
    head_dim = head_dim_of(config)
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    for name, tensor in weights:
        projection = next((p for p in heads if f"self_attn.{p}." in name), None)
        if projection is not None:
            order = (np.arange(heads[projection])[:, None] * head_dim + within[None, :]).reshape(-1)
            tensor = rows_reordered(tensor, order, name)
        yield name, tensor
