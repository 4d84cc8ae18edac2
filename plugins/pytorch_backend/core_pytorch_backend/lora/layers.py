"""The LoRA term of a linear layer, for a step whose rows run through different adapters.

Each targeted layer gets a `LoraLayer` beside its weight: ``y = base(x) + (x A^T) B^T`` where ``base`` is
whatever matmul the layer has (dense, upcast or packed), so adapters work over every kind of base weight.
The scaling (lora_alpha / r, or / sqrt(r) for rsLoRA) is folded into B when an adapter is loaded.
A fused layer (q/k/v, gate/up) keeps its shards' A matrices stacked ([shards * R, in]) and B block-diagonal
([shards * R, out], kept transposed), so one adapter costs two matmuls per layer whatever the fusion; ranks
below the maximum R are zero-padded (exact).

Rows of a step choose their slot through the model's one `LoraStep` (set by the runner before the forward
pass), which picks one of three ways to run the step, the same for every layer:
- every row on one adapter: ``y + (x A^T) B^T`` with that slot's matrices;
- a small mixed step (decode): every slot up to the highest one used at once, ``h = x [A_0; A_1; ...]^T``,
  ``h`` masked to each row's own slot, then ``y + h [B_0; B_1; ...]^T``: three ops a layer whatever the
  number of adapters, where grouping costs five per adapter;
- a large mixed step (prefill): rows grouped by adapter, each group gathered, multiplied and added back
  with `index_add`, so the work does not grow with the number of slots.
Measured on one thread of the Zen 5 EPYC (4 slots of rank 16, SmolLM2's qkv/gate_up/down shapes), the
mask is faster up to about 16 rows: MASKED_ROWS below.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from core_pytorch_backend.native.library import CpuKernels
from core_pytorch_backend.native.packed_weight import DTYPE_CODES

MASKED_ROWS = 16  # mixed steps of up to this many rows take the masked path (see the module docstring)


class LoraStep:
    """Which rows of the current step use which slot (set by the runner, read by every `LoraLayer`).

    ``row_slots``: each row's slot as int32 (-1: the base alone) for the native kernel, or None.
    ``single``: the slot every row uses, or None. ``mask``: [rows, slots used] one-hot (the masked path),
    or None. ``groups``: (slot, rows) pairs (the grouped path). With the native kernel only ``row_slots``
    is set; otherwise at most one of the other three.
    """

    def __init__(self, dtype: torch.dtype = torch.float32, native: bool = False) -> None:
        self.dtype = dtype  # the adapters' (the mask's) dtype
        self.native = native
        self.num_rows = 0  # rows of the step the slots are for
        self.row_slots: torch.Tensor | None = None
        self.single: int | None = None
        self.mask: torch.Tensor | None = None
        self.groups: list[tuple[int, torch.Tensor]] = []

    @property
    def active(self) -> bool:
        return self.row_slots is not None or self.single is not None or self.mask is not None or bool(self.groups)

    def set_rows(self, row_slots: Sequence[int], device: torch.device) -> None:
        """One slot per row of the step (-1: the base model alone)."""
        self.clear()
        self.num_rows = len(row_slots)
        used = sorted(set(row_slots) - {-1})
        if not used:
            return
        if self.native:
            self.row_slots = torch.tensor(row_slots, dtype=torch.int32)
            return
        if len(used) == 1 and -1 not in row_slots:
            self.single = used[0]
            return
        slots = torch.tensor(row_slots, dtype=torch.int64)
        if len(row_slots) <= MASKED_ROWS:
            width = used[-1] + 1  # a base row (-1) gets an all-zero row of the mask
            self.mask = (slots[:, None] == torch.arange(width)).to(device=device, dtype=self.dtype)
            return
        self.groups = [(s, torch.nonzero(slots == s).flatten().to(device)) for s in used]

    def clear(self) -> None:
        self.row_slots, self.single, self.mask, self.groups, self.num_rows = None, None, None, [], 0


class LoraLayer:
    """The slots of one linear layer: A [slots, shards, R, in], shard j's B^T [slots, R, out_j] (one flat
    buffer, the native kernel's layout: csrc/lora.c) and each slot's rank."""

    def __init__(self, step: LoraStep, num_slots: int, max_rank: int, input_size: int, output_sizes: Sequence[int],
                 device: torch.device, dtype: torch.dtype, kernels: CpuKernels | None = None) -> None:
        self.step = step
        self.kernels = kernels  # the native CPU kernels, or None: the torch paths
        self.max_rank = max_rank
        self.output_sizes = list(output_sizes)
        self.starts = [sum(self.output_sizes[:j]) for j in range(len(self.output_sizes))]
        self.a = torch.zeros(num_slots, len(self.output_sizes), max_rank, input_size, device=device, dtype=dtype)
        self.bt_flat = torch.zeros(num_slots * max_rank * sum(self.output_sizes), device=device, dtype=dtype)
        self.bt = [self.bt_flat[num_slots * max_rank * start : num_slots * max_rank * (start + size)]
                   .view(num_slots, max_rank, size) for start, size in zip(self.starts, self.output_sizes, strict=True)]
        self.rank = torch.zeros(num_slots, dtype=torch.int32)
        self._shard_start = torch.tensor(self.starts, dtype=torch.int64)
        self._shard_size = torch.tensor(self.output_sizes, dtype=torch.int64)

    def load(self, slot: int, shards: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Fill `slot` from {shard index: (A [r, in], scaled B [out_shard, r])}; absent shards stay zero."""
        self.clear(slot)
        for index, (a, b) in shards.items():
            rank = a.shape[0]
            self.a[slot, index, :rank] = a.to(self.a.dtype)
            self.bt[index][slot, :rank] = b.T.to(self.a.dtype)
            self.rank[slot] = max(int(self.rank[slot]), rank)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        for bt in self.bt:
            bt[slot].zero_()
        self.rank[slot] = 0

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        step = self.step
        if x.shape[0] != step.num_rows or not step.active:
            # not the step's rows: no step (a pooling or probing call), or another thread's call of a
            # layer outside the decoder (a vision tower encoding images while a step runs): no adapter
            return y
        if step.row_slots is not None:
            return self._native(x, y, step.row_slots)
        if step.single is not None:
            return self._add(y, self._expand(self._shrink(x, step.single, step.single + 1), step.single,
                                             step.single + 1))
        if step.mask is not None:
            h = self._shrink(x, 0, step.mask.shape[1]).mul_(step.mask[:, :, None, None])
            return self._add(y, self._expand(h, 0, step.mask.shape[1]))
        for slot, rows in step.groups:
            delta = self._expand(self._shrink(x.index_select(0, rows), slot, slot + 1), slot, slot + 1)
            y = y.index_add(0, rows, delta.to(y.dtype))
        return y

    def _shrink(self, x: torch.Tensor, first: int, end: int) -> torch.Tensor:
        """x [rows, in] against the A of slots first..end-1: [rows, slots, shards, R]."""
        a = self.a[first:end]
        return (x.to(a.dtype) @ a.reshape(-1, a.shape[-1]).T).view(x.shape[0], *a.shape[:3])

    def _expand(self, h: torch.Tensor, first: int, end: int) -> torch.Tensor:
        """h [rows, slots, shards, R] against each shard's B^T of slots first..end-1: [rows, out]."""
        rows, width = h.shape[0], (end - first) * self.max_rank
        parts = [h[:, :, j].reshape(rows, width) @ bt[first:end].reshape(width, -1) for j, bt in enumerate(self.bt)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    @staticmethod
    def _add(y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return y + delta.to(y.dtype)

    def _native(self, x: torch.Tensor, y: torch.Tensor, row_slots: torch.Tensor) -> torch.Tensor:
        """The native kernel adds the term to y in place. The manager turns it on only for float32 models on
        the CPU (lora/manager.py), whose layers take and give [rows, features] float32 tensors."""
        if x.dtype != torch.float32 or y.dtype != torch.float32 or x.dim() != 2:
            raise TypeError(f"the native LoRA kernel takes float32 [rows, features] tensors, got {x.dtype} "
                            f"{tuple(x.shape)} -> {y.dtype}")
        x, y = x.contiguous(), y.contiguous()
        rows, width = x.shape
        status = self.kernels.function("core_lora_apply")(
            x.data_ptr(), rows, width, y.data_ptr(), y.shape[1], row_slots.data_ptr(), self.a.shape[0],
            self.rank.data_ptr(), self.max_rank, len(self.bt), self._shard_start.data_ptr(),
            self._shard_size.data_ptr(), self.a.data_ptr(), self.bt_flat.data_ptr(), DTYPE_CODES[self.a.dtype])
        if status:
            self.kernels.raise_for("core_lora_apply", status)
        return y
