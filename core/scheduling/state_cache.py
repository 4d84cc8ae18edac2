"""Prefix caching for a model with recurrent state: snapshots of the state at block boundaries.

Cached KV blocks give an attention layer everything it needs to start a sequence at a block boundary; a
recurrent layer needs its state as it was after exactly those tokens. So the scheduler ends one prefill
chunk of each prompt at its last block boundary before the final token (``snapshot_position``) and, once
that chunk has run, copies the sequence's state slot into a slot of this cache, keyed by the hash of the
block that ends there (the chain hash of every token before it). A later sequence whose prompt starts with
those blocks (the next turn of a chat: the conversation so far, then a new message) takes the KV blocks up
to the deepest boundary with a snapshot and a copy of that snapshot into its own slot, and computes only
the rest.

The cache holds at most ``capacity`` snapshots, least recently used evicted first, in slots of its own (the
backend keeps them apart from the running sequences' states, whose slots thus stay dense: a decode step's
states are then one run of slots, not a gather), and ``clear`` gives them all back. It holds numbers only: the
copies it asks for are made by the backend (``SchedulerOutput.snapshot_copies``, ``snapshot_restores``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as SequenceABC

from core.scheduling.state_slots import StateSlots


def snapshot_position(num_prompt_tokens: int, block_size: int) -> int:
    """Where a prompt's state is kept: its last block boundary before its final token (0: none)."""
    return (num_prompt_tokens - 1) // block_size * block_size


class StateCache:
    """Recurrent-state snapshots by block hash, LRU, in snapshot slots of their own."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.slots = StateSlots()
        self.capacity = capacity
        self._by_hash: OrderedDict[bytes, int] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._by_hash)

    def lookup(self, block_hashes: SequenceABC[bytes]) -> tuple[int, int] | None:
        """The deepest of a prefix's blocks (their chain hashes, in order) with a snapshot after it:
        ``(blocks, slot)``, the snapshot being the state after ``blocks`` blocks; None if none has one."""
        for index in range(len(block_hashes) - 1, -1, -1):
            slot = self._by_hash.get(block_hashes[index])
            if slot is not None:
                self._by_hash.move_to_end(block_hashes[index])
                return index + 1, slot
        return None

    def store(self, block_hash: bytes, src: int) -> tuple[int, int] | None:
        """Keep slot ``src``'s state as the snapshot after the block of ``block_hash``: the ``(src, dst)``
        copy to make before ``src`` changes, or None where it is kept already (or the cache holds none)."""
        if block_hash in self._by_hash:
            self._by_hash.move_to_end(block_hash)
            return None
        if self.capacity == 0:
            return None
        if len(self._by_hash) >= self.capacity:
            _, dst = self._by_hash.popitem(last=False)
        else:
            dst = self.slots.take_slot()
        self._by_hash[block_hash] = dst
        return src, dst

    def clear(self) -> None:
        """Forget every snapshot and give its slot back (the states were freed)."""
        for slot in self._by_hash.values():
            self.slots.release_slot(slot)
        self._by_hash.clear()
