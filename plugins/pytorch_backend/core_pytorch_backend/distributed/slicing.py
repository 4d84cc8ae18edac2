"""One rank's slice of each checkpoint tensor, dense or still quantized (`AffineWeight` codes).

Weights are cut as they stream from the checkpoint, before the model's ``load_weights`` sees them, so a
rank never holds another rank's part for longer than one tensor. Quantized codes are cut along their
output rows freely and along their inputs on group boundaries; a row-parallel cut that would split a
group is dequantized first (logged), so any GGUF file shards.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping

import numpy as np
import torch

from ..quant.affine import AffineWeight
from .plan import COLUMN, KV_COLUMN, ROW, VOCAB, ShardLayout, kind_of

log = logging.getLogger(__name__)
Tensor = torch.Tensor | AffineWeight


def shard_weights(weights: Iterable[tuple[str, Tensor]], plan: Mapping[str, str],
                  layout: ShardLayout) -> Iterator[tuple[str, Tensor]]:
    """(name, this rank's slice) for every (HF name, tensor) of a checkpoint; replicated ones pass whole."""
    for name, tensor in weights:
        kind = kind_of(name, plan)
        yield name, tensor if kind is None else shard_tensor(name, tensor, kind, layout)


def shard_tensor(name: str, tensor: Tensor, kind: str, layout: ShardLayout) -> Tensor:
    """The slice of `tensor` (a weight [out, in] or a bias [out]) that `layout`'s rank holds."""
    if kind == COLUMN:
        rows = tensor.shape[0] // layout.world
        return _rows(tensor, layout.rank * rows, rows)
    if kind == KV_COLUMN:
        rows = layout.num_kv_heads * layout.head_dim
        return _rows(tensor, layout.kv_head_start * layout.head_dim, rows)
    if kind == VOCAB:
        return _padded_rows(tensor, layout.vocab_start, layout.vocab_per_rank)
    if kind == ROW:
        if len(tensor.shape) == 1:  # the bias is added once: after the all-reduce, by rank 0's share
            return tensor if layout.rank == 0 else torch.zeros_like(tensor)
        cols = tensor.shape[1] // layout.world
        return _columns(name, tensor, layout.rank * cols, cols)
    raise ValueError(f"unknown shard kind {kind!r} for {name}")


def _rows(tensor: Tensor, start: int, count: int) -> Tensor:
    if isinstance(tensor, AffineWeight):
        return tensor.rows(np.arange(start, start + count))
    return tensor[start : start + count].clone()


def _padded_rows(tensor: Tensor, start: int, count: int) -> Tensor:
    """Rows [start, start + count), zero rows past the end of `tensor` (the last rank's vocabulary)."""
    stop = min(start + count, tensor.shape[0])
    part = _rows(tensor, start, max(stop - start, 0))
    missing = count - part.shape[0]
    if missing <= 0:
        return part
    if isinstance(part, AffineWeight):
        groups = part.scale.shape[1]
        scales = np.zeros((missing, groups), np.float32)
        zeros = AffineWeight(np.zeros((missing, part.shape[1]), np.uint8), scales, scales.copy(), part.bits,
                             part.group_size)
        return AffineWeight.concat([part, zeros])
    return torch.cat([part, part.new_zeros((missing, *part.shape[1:]))])


def _columns(name: str, tensor: Tensor, start: int, count: int) -> Tensor:
    if not isinstance(tensor, AffineWeight):
        return tensor[:, start : start + count].clone()
    g = tensor.group_size
    if start % g or count % g:
        log.info("%s: a row-parallel slice of %d inputs splits its groups of %d; dequantized", name, count, g)
        return torch.from_numpy(tensor.dequantize()[:, start : start + count].copy())
    groups = slice(start // g, (start + count) // g)
    return AffineWeight(np.ascontiguousarray(tensor.q[:, start : start + count]),
                        np.ascontiguousarray(tensor.scale[:, groups]),
                        np.ascontiguousarray(tensor.offset[:, groups]), tensor.bits, g)
