"""Which rows of the forward pass in progress the packed weights multiply on the AMX tiles.

On a CPU with AMX (an ``amx-bf16`` build whose process Linux grants the tiles), ``NativeWeight`` has two
loops: the VNNI loop (exact integer dots of the 4/8-bit codes with activations in two int8 steps; from 16
rows a call it takes those dots on the tiles too, 16 rows at a time, with the same bits) and the bf16
tile loop (the codes dequantized to bfloat16, float32 sums over all of K: 2-2.6x faster from 64 rows on,
several times slower at one). They round differently, so the rule that picks one must not depend on the
batch a row is in, or a request's greedy output would depend on whether its prompt's prefix was cached
or which requests shared its steps (DESIGN.md: the packed kernel). The rule here is a property of the
token: **a prompt token's row takes the tiles, a generated token's row the VNNI loop**, whatever the
step holds. Prompt tokens come many to a step (prefill chunks: the tiles' strength), generated tokens a
few to a sequence (decode steps, speculative verification, a preempted sequence's recomputed output),
and the LM head, whose rows are no prompt token's own, takes the VNNI loop. That is the ``prompt`` rule,
the default. The ``all`` rule (``--amx-rows all``) puts every row on the tiles, generated tokens' and
the LM head's too: as batch-independent (one loop for every row), faster from 16 rows a step (decode
steps of 16 / 32 / 64 rows 1.2x / 1.5x / 1.7x on the 2-core Xeon), 2.9x slower at one row (a lone stream);
a choice of the server, not of the batch.

The model runner (where ``has_tiled_weights``) marks the step (``prompt_token_rows``: the rows' spans) around its forward pass; each
``NativeWeight.linear`` of the pass reads ``current()``. Nothing is marked outside a pass, and a weight
called with another number of rows than the step's (none in the decoders this backend runs) takes the
VNNI loop for all of them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TileRows:
    """The current step's rows as maximal runs of neighbouring rows, (first, stop, tiled) in order: ``tiled``
    runs take the tile loop, the others the VNNI loop; no runs: every row is tiled. A weight multiplies each
    run in place (a step's decode rows and its prompt chunks are a few runs)."""

    total: int
    runs: tuple[tuple[int, int, bool], ...] = ()

    @property
    def all_tiled(self) -> bool:
        return not self.runs

    def rows(self, tiled: bool) -> torch.Tensor:
        """The int64 indices of the tiled (or the other) rows, in order."""
        return torch.cat([torch.arange(first, stop) for first, stop, kind in self.runs if kind == tiled])


_local = threading.local()
RULES = {"prompt": "prompt tokens' rows of the packed matmuls on the tiles, generated tokens' by the VNNI loop",
         "all": "every row of the packed matmuls on the tiles, the LM head's too (--amx-rows all)"}


def current() -> TileRows | None:
    """The marked step of this thread's forward pass, or None (every row takes the VNNI loop)."""
    return getattr(_local, "rows", None)


def rows_of(spans: Sequence[tuple[int, int]], total: int) -> TileRows | None:
    """The TileRows of a step of `total` rows whose prompt-token rows are `spans` ((first row, count), in
    order); None when there are none."""
    spans = [(first, count) for first, count in spans if count > 0]
    tiled_count = sum(count for _, count in spans)
    if tiled_count == 0:
        return None
    if tiled_count == total:
        return TileRows(total)
    return TileRows(total, _runs(spans, total))


def _runs(spans: Sequence[tuple[int, int]], total: int) -> tuple[tuple[int, int, bool], ...]:
    """[0, total) as maximal runs of tiled (in `spans`, in order, non-empty) and other rows."""
    runs: list[tuple[int, int, bool]] = []
    at = 0
    for first, count in spans:
        if first > at:
            runs.append((at, first, False))
        if runs and runs[-1][2] and runs[-1][1] == first:  # touching the previous span
            runs[-1] = (runs[-1][0], first + count, True)
        else:
            runs.append((first, first + count, True))
        at = first + count
    if at < total:
        runs.append((at, total, False))
    return tuple(runs)


def has_tiled_weights(model: torch.nn.Module) -> bool:
    """Whether `model` has packed weights whose kernels have AMX tiles (the runner then marks its steps)."""
    from .packed_weight import NativeWeight  # it imports this module

    return any(isinstance(m, NativeWeight) and m.kernels.uses_amx for m in model.modules())


def marked(rule: str, spans: Sequence[tuple[int, int]], total: int) -> TileRows | None:
    """The rows of a step of `total` rows that `rule` (one of RULES) puts on the tiles."""
    return TileRows(total) if rule == "all" and total else rows_of(spans, total)


@contextmanager
def prompt_token_rows(rows: TileRows | None) -> Iterator[None]:
    """Mark this thread's forward pass (None: nothing to mark)."""
    previous = current()
    _local.rows = rows
    try:
        yield
    finally:
        _local.rows = previous
