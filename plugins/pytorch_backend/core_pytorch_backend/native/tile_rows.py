"""Which rows of the forward pass in progress the packed weights multiply by their prompt loop.

On a CPU with AVX512-BF16, ``NativeWeight`` has two loops: the VNNI loop (exact integer dots of the 4/8-bit
codes with activations in two int8 steps; on AMX CPUs from 16 rows a call it takes those dots on the tiles
too, 16 rows at a time, with the same bits) and the prompt loop (the codes dequantized to bfloat16, the
activations rounded to bfloat16, float32 sums over all of K; ``CpuKernels.prompt_loop``): on AMX CPUs (an
``amx-bf16`` build whose process Linux grants the tiles) the tile loop, 2-2.6x faster than the VNNI loop
from 64 rows on, and elsewhere (Zen 4 and later EPYCs) the vector prompt loop (``vdpbf16ps`` on a few
dequantized blocks at a time), 1.1-1.5x faster from 64 rows on; both several times slower at one row. "The
tiles" below means either. They round differently, so the rule that picks one must not depend on the
batch a row is in, or a request's greedy output would depend on whether its prompt's prefix was cached
or which requests shared its steps (DESIGN.md: the packed kernel). The rule here is a property of the
token: **a prompt token's row takes the tiles, a generated token's row the VNNI loop**, whatever the
step holds. Prompt tokens come many to a step (prefill chunks: the tiles' strength), generated tokens a
few to a sequence (decode steps, speculative verification, a preempted sequence's recomputed output),
and the LM head, whose rows are no prompt token's own, takes the VNNI loop. That is the ``prompt`` rule,
the default. The ``all`` rule (``--amx-rows all``) puts every row on the tiles, generated tokens' and
the LM head's too: as batch-independent (one loop for every row), faster from 16 rows a step (decode
steps of 16 / 32 / 64 rows 1.2x / 1.5x / 1.7x on the 2-core Xeon), 2.9x slower at one row (a lone stream);
a choice of the server, not of the batch. The ``none`` rule (``--amx-rows none``) marks nothing: every row
by the VNNI loop, whose two int8 steps follow the float model more closely (the default model's top-1
agreement with its float32 oracle, teacher-forced: 99.75% against the prompt loop's 99.45%), prompts slower.

The model runner (where ``has_tiled_weights``) marks the step (``prompt_token_rows``: the rows' spans) around its forward pass; each
``NativeWeight.linear`` of the pass reads ``current()``. Nothing is marked outside a pass, and a weight
called with another number of rows than the step's takes the VNNI loop for all of them, so a caller that
multiplies a subset of the step's rows (a MoE block's experts, each on the rows of the tokens that chose it)
marks that subset as its own rows are marked (``gathered``).
"""

from __future__ import annotations

import functools
import itertools
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

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """Each row's True where it is tiled (bool [total]; built once a step, read by each expert of each MoE
        layer: not to be written)."""
        tiled = torch.ones(self.total, dtype=torch.bool)
        for first, stop, kind in self.runs:
            tiled[first:stop] = kind
        return tiled


_local = threading.local()
RULES = {"prompt": "prompt tokens' rows of the packed matmuls by the prompt loop, generated tokens' by the VNNI loop",
         "all": "every row of the packed matmuls by the prompt loop, the LM head's too (--amx-rows all)",
         "none": "every row of the packed matmuls by the VNNI loop, the prompt loop unused (--amx-rows none)"}


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


def prompt_loop_of(model: torch.nn.Module) -> str | None:
    """The prompt loop of `model`'s packed weights' kernels ("amx" or "vectors": ``CpuKernels.prompt_loop``), or
    None where it has no packed weights or their kernels have none."""
    from .packed_weight import NativeWeight  # it imports this module

    return next((m.kernels.prompt_loop for m in model.modules()
                 if isinstance(m, NativeWeight) and m.kernels.prompt_loop is not None), None)


def has_tiled_weights(model: torch.nn.Module) -> bool:
    """Whether `model` has packed weights whose kernels have a prompt loop (the runner then marks its steps)."""
    return prompt_loop_of(model) is not None


def marked(rule: str, spans: Sequence[tuple[int, int]], total: int) -> TileRows | None:
    """The rows of a step of `total` rows that `rule` (one of RULES) puts on the tiles."""
    if rule == "none":
        return None
    return TileRows(total) if rule == "all" and total else rows_of(spans, total)


@contextmanager
def gathered(rows: torch.Tensor, total: int) -> Iterator[None]:
    """Mark the forward pass's calls inside as of ``rows`` (int64 indices, in the order gathered) of a tensor of
    ``total`` rows, each marked as it is in the step: a MoE expert's rows, whose prompt tokens' rows then take the
    prompt loop whichever other tokens chose that expert (unmarked, every row took the VNNI loop unless all the
    step's tokens had chosen it). Nothing is marked where the step has no marks or the tensor is not of its rows
    (the VNNI loop for all, as a call of another row count takes)."""
    marks = current()
    if marks is None or marks.total != total:
        with prompt_token_rows(None):
            yield
        return
    spans, at = [], 0
    for tiled, run in itertools.groupby(marks.mask[rows].tolist()):  # the runs of marked rows, (first, count)
        count = len(list(run))
        if tiled:
            spans.append((at, count))
        at += count
    with prompt_token_rows(rows_of(spans, len(rows))):
        yield


@contextmanager
def prompt_token_rows(rows: TileRows | None) -> Iterator[None]:
    """Mark this thread's forward pass (None: nothing to mark)."""
    previous = current()
    _local.rows = rows
    try:
        yield
    finally:
        _local.rows = previous
