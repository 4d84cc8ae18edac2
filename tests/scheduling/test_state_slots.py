"""Recurrent-state slots through the scheduler: one slot per running sequence, given back on finish, abort
and preemption, copied on fork; a simulated state (the tokens a slot has seen) must always be exactly the
sequence's computed tokens."""

from __future__ import annotations

import random

import pytest

from core.scheduling import BlockManager, Scheduler, Sequence, StateSlots
from core.testing.recurrent_state import SimulatedStates, check_slots, drive_randomly


def scheduler(num_blocks=64, block_size=4, **kwargs) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size, enable_prefix_caching=False), state_slots=StateSlots(),
                     **kwargs)


def test_lowest_free_slot_first_and_release_is_idempotent():
    slots = StateSlots()
    a, b, c = (Sequence(name, [1]) for name in "abc")
    assert [slots.take(a), slots.take(b), slots.take(c)] == [0, 1, 2]
    slots.release(b)
    slots.release(b)
    slots.release(a)
    assert slots.in_use == 1 and a.state_slot is None
    assert slots.take(Sequence("d", [1])) == 0
    assert slots.peak == 3
    with pytest.raises(ValueError, match="already holds"):
        slots.take(c)


def test_finish_abort_and_preemption_give_the_slot_back():
    sched = scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    model = SimulatedStates()
    first, second = Sequence("a", range(10)), Sequence("b", range(10))
    sched.add(first)
    sched.add(second)
    out = sched.schedule()
    model.run(out)
    assert {first.state_slot, second.state_slot} == {0, 1}
    sched.update(out, {"a": 7, "b": 7})
    for _ in range(3):  # both grow past the 6 blocks: the later arrival is preempted
        out = sched.schedule()
        model.run(out)
        sched.update(out, {s.seq.seq_id: 7 for s in out.scheduled if s.samples})
        check_slots(sched)
        if out.preempted:
            break
    assert out.preempted == [second] and second.state_slot is None
    sched.abort("a")
    assert sched.state_slots.in_use == 0
    out = sched.schedule()  # the preempted sequence recomputes from position 0, in the lowest slot
    model.run(out)
    assert out.scheduled[0].start == 0 and second.state_slot == 0
    sched.finish(second)
    assert sched.state_slots.in_use == 0


def test_a_fork_gets_its_own_slot_and_a_copy_of_its_parents_state():
    sched = scheduler()
    model = SimulatedStates()
    parent = Sequence("p", range(9))
    sched.add(parent)
    out = sched.schedule()
    model.run(out)
    sched.update(out, {"p": 5})
    child = parent.fork("p.1")
    sched.fork(parent, child)
    out = sched.schedule()
    assert out.state_copies == [(parent.state_slot, child.state_slot)] and child.state_slot != parent.state_slot
    model.run(out)  # the child's chunk finds the parent's state in its own slot
    assert sched.schedule().state_copies == []


@pytest.mark.parametrize("seed", range(12))
def test_randomised_loop_keeps_each_state_in_step(seed):
    rng = random.Random(seed)
    sched = scheduler(num_blocks=rng.randrange(12, 40), block_size=rng.choice([1, 4, 16]),
                      max_num_seqs=rng.choice([2, 4, 64]), max_num_batched_tokens=rng.choice([8, 32, 256]))
    capacity = sched.block_manager.num_blocks * sched.block_manager.block_size
    drive_randomly(sched, rng, lambda _: [rng.randrange(1000) for _ in range(rng.randrange(1, min(40, capacity)))])
    assert sched.state_slots.in_use == 0
    assert sched.state_slots.peak <= sched.max_num_seqs + 40  # forks may run beyond max_num_seqs
