"""Slots of a model's per-sequence recurrent state (Mamba, gated DeltaNet, short convolutions).

A model with recurrent layers keeps, besides any KV blocks, one fixed-size state per running sequence, in
slot ``seq.state_slot`` of its state tensors. A sequence takes a slot when it starts running and gives it
back when it finishes, is aborted or is preempted (its recompute starts from a zero state at position 0);
a fork takes a slot of its own, which the backend fills with a copy of its parent's state before the next
step (``SchedulerOutput.state_copies``). The lowest free slot is handed out first, so the state tensors grow
only to the most sequences that ran at once. The prefix cache numbers its snapshots with a ``StateSlots`` of
its own (``take_slot``, state_cache.py).
"""

from __future__ import annotations

import heapq

from core.scheduling.sequence import Sequence


class StateSlots:
    """Hands out slot numbers to sequences; ``peak`` is how many slots were ever in use at once."""

    def __init__(self) -> None:
        self._free: list[int] = []  # a min-heap of released slots below _next
        self._next = 0
        self.in_use = 0

    @property
    def peak(self) -> int:
        """One more than the highest slot ever handed out."""
        return self._next

    def take(self, seq: Sequence) -> int:
        """Give ``seq`` a slot (it must hold none)."""
        if seq.state_slot is not None:
            raise ValueError(f"sequence {seq.seq_id!r} already holds state slot {seq.state_slot}")
        seq.state_slot = self.take_slot()
        return seq.state_slot

    def release(self, seq: Sequence) -> None:
        """Take ``seq``'s slot back (a no-op if it holds none)."""
        if seq.state_slot is None:
            return
        self.release_slot(seq.state_slot)
        seq.state_slot = None

    def take_slot(self) -> int:
        """The lowest free slot, for a holder that is not a sequence (a cached snapshot: state_cache.py)."""
        if self._free:
            slot = heapq.heappop(self._free)
        else:
            slot = self._next
            self._next += 1
        self.in_use += 1
        return slot

    def release_slot(self, slot: int) -> None:
        heapq.heappush(self._free, slot)
        self.in_use -= 1
