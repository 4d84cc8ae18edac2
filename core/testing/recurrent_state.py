"""A scheduler driver for models with recurrent state: it plays the backend's part with a simulated state (the
tokens each slot has seen) and checks that every chunk finds its sequence's computed tokens in its slot.

`SimulatedStates.run(out)` makes a step's copies as a backend makes them (``snapshot_copies`` into the
snapshots, ``snapshot_restores`` out of them, then ``state_copies``, each batch's sources read before any
destination is written) and runs its chunks: a chunk
at position 0 starts from an empty state, any other must find exactly the tokens before it. `drive_randomly`
runs a scheduler for a few hundred steps of arrivals, finishes, aborts and forks, checking the slots after
each; a backend's scheduler settings (or a third party's scheduler) can be put through it.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from core.scheduling import Scheduler, Sequence, SequenceStatus


class SimulatedStates:
    """State per slot: the tokens it has consumed; the prefix cache's snapshots apart."""

    def __init__(self) -> None:
        self.state: dict[int, list[int]] = {}
        self.snapshots: dict[int, list[int]] = {}

    @staticmethod
    def copy(sources: dict[int, list[int]], targets: dict[int, list[int]], copies: list[tuple[int, int]]) -> None:
        values = [list(sources[src]) for src, _ in copies]
        for (_, dst), value in zip(copies, values, strict=True):
            targets[dst] = value

    def run(self, out) -> None:
        self.copy(self.state, self.snapshots, out.snapshot_copies)
        self.copy(self.snapshots, self.state, out.snapshot_restores)
        self.copy(self.state, self.state, out.state_copies)
        for chunk in out.scheduled:
            seq = chunk.seq
            if chunk.start == 0:
                self.state[seq.state_slot] = []
            assert self.state[seq.state_slot] == seq.token_ids[: chunk.start], f"{seq.seq_id}: state out of step"
            self.state[seq.state_slot].extend(chunk.token_ids)


def check_slots(sched: Scheduler) -> None:
    """Each running sequence holds a slot of its own, a waiting one none, and only they hold slots (the state
    cache's snapshots have slots of their own, one a snapshot)."""
    slots = [s.state_slot for s in sched.running]
    assert None not in slots and len(slots) == len(set(slots)), slots
    assert all(s.state_slot is None for s in sched.waiting)
    assert sched.state_slots is not None and sched.state_slots.in_use == len(slots)
    if sched.state_cache is not None:
        assert sched.state_cache.slots.in_use == len(sched.state_cache) <= sched.state_cache.capacity
    assert all(s.status is SequenceStatus.RUNNING for s in sched.running)


def drive_randomly(sched: Scheduler, rng: random.Random, new_prompt: Callable[[list[list[int]]], list[int]],
                   steps: int = 400) -> None:
    """``steps`` steps (arrivals in the first three quarters; ``new_prompt(finished)`` makes each from the
    token lists of the sequences finished so far), each checked, then everything finished."""
    model = SimulatedStates()
    budget: dict[str, int] = {}
    finished: list[list[int]] = []
    for step in range(steps):
        if step < steps * 3 // 4 and rng.random() < 0.4:
            seq = Sequence(f"r{step}", new_prompt(finished))
            budget[seq.seq_id] = seq.num_tokens + rng.randrange(1, 16)
            sched.add(seq)
        out = sched.schedule()
        model.run(out)
        sched.update(out, {s.seq.seq_id: rng.randrange(1000) for s in out.scheduled if s.samples})
        for seq in list(sched.running):
            if seq.num_tokens >= budget.get(seq.seq_id, 0):
                finished.append(list(seq.token_ids))
                sched.finish(seq)
        if sched.running and rng.random() < 0.05:
            sched.abort(rng.choice(sched.running).seq_id)
        parents = [s for s in sched.running if s.num_output_tokens]
        if parents and rng.random() < 0.1:
            parent = rng.choice(parents)
            child = parent.fork(f"{parent.seq_id}.{step}")
            budget[child.seq_id] = child.num_tokens + rng.randrange(1, 8)
            sched.fork(parent, child)
        check_slots(sched)
    while sched.has_unfinished:
        for seq in list(sched.running) + list(sched.waiting):
            sched.finish(seq)
