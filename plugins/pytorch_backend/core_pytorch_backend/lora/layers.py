"""The LoRA term of a linear layer, for a step whose rows run through different adapters.

Each targeted layer gets a `LoraLayer` beside its weight: ``y = base(x) + (x A^T) B^T`` where ``base`` is
whatever matmul the layer has (dense, upcast or packed), so adapters work over every kind of base weight.
The scaling (lora_alpha / r, or / sqrt(r) for rsLoRA) is folded into B when an adapter is loaded.
A fused layer (q/k/v, gate/up) keeps its shards' A matrices stacked ([shards * R, in]) and B block-diagonal
([out, shards * R]), so one adapter costs two matmuls per layer whatever the fusion; ranks below the
maximum R are zero-padded (exact).

Rows of a step choose their slot through the model's one `LoraStep` (set by the runner before the
forward pass). Rows are grouped by adapter: each group is gathered, multiplied and added back with
`index_add`, and a step where every row uses one adapter multiplies without gathering. Gathering A and
B per row instead (a batched matmul over [rows, R, in]) was measured on the CPU (2 threads, 576 -> 1536,
R 16, 4 adapters): 2x faster at 8 rows, but 2.5x slower at 32 and 4x slower at 256 (prefill), so rows
are grouped; a gather path for small decode steps is a possible refinement (docs/DESIGN.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class LoraStep:
    """Which rows of the current step use which slot: ``groups`` of (slot, rows or None for all rows)."""

    def __init__(self) -> None:
        self.groups: list[tuple[int, torch.Tensor | None]] = []

    @property
    def active(self) -> bool:
        return bool(self.groups)

    def set_rows(self, row_slots: Sequence[int], device: torch.device) -> None:
        """One slot per row of the step (-1: the base model alone)."""
        used = sorted(set(row_slots) - {-1})
        if len(used) == 1 and -1 not in row_slots:
            self.groups = [(used[0], None)]
            return
        slots = torch.tensor(row_slots, dtype=torch.int64)
        self.groups = [(s, torch.nonzero(slots == s).flatten().to(device)) for s in used]

    def clear(self) -> None:
        self.groups = []


class LoraLayer:
    """The slots of one linear layer: A [slots, shards * R, in] and B [slots, out, shards * R]."""

    def __init__(self, step: LoraStep, num_slots: int, max_rank: int, input_size: int, output_sizes: Sequence[int],
                 device: torch.device, dtype: torch.dtype) -> None:
        self.step = step
        self.max_rank = max_rank
        self.output_sizes = list(output_sizes)
        width = len(self.output_sizes) * max_rank
        self.a = torch.zeros(num_slots, width, input_size, device=device, dtype=dtype)
        self.b = torch.zeros(num_slots, sum(self.output_sizes), width, device=device, dtype=dtype)

    def load(self, slot: int, shards: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Fill `slot` from {shard index: (A [r, in], scaled B [out_shard, r])}; absent shards stay zero."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        for index, (a, b) in shards.items():
            first, rank = index * self.max_rank, a.shape[0]
            start = sum(self.output_sizes[:index])
            self.a[slot, first : first + rank] = a.to(self.a.dtype)
            self.b[slot, start : start + b.shape[0], first : first + rank] = b.to(self.b.dtype)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for slot, rows in self.step.groups:
            a, b = self.a[slot], self.b[slot]
            if rows is None:
                y = y + (x.to(a.dtype) @ a.T @ b.T).to(y.dtype)
            else:
                delta = x.index_select(0, rows).to(a.dtype) @ a.T @ b.T
                y = y.index_add(0, rows, delta.to(y.dtype))
        return y
