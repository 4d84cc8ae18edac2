"""Prefix caching for recurrent state: snapshots kept at prompts' last block boundaries, restored into a new
sequence's slot on a prefix-cache hit; a simulated state (the tokens a slot has seen) must always be exactly
the sequence's computed tokens, whatever hits, evictions, preemptions, aborts and forks happen."""

from __future__ import annotations

import random

import pytest

from core.scheduling import BlockManager, Scheduler, Sequence, StateCache, StateSlots
from core.scheduling.state_cache import snapshot_position
from core.testing.recurrent_state import SimulatedStates, drive_randomly


def scheduler(num_blocks=64, block_size=4, snapshots=8, **kwargs) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size), state_slots=StateSlots(),
                     state_cache=StateCache(snapshots), **kwargs)


def run_to_end(sched: Scheduler, model: SimulatedStates, new_tokens: int = 3) -> None:
    """Steps until every sequence has `new_tokens` outputs, then finishes them."""
    while sched.running or sched.waiting:
        out = sched.schedule()
        model.run(out)
        sched.update(out, {s.seq.seq_id: 900 + s.seq.num_output_tokens for s in out.scheduled if s.samples})
        for seq in list(sched.running):
            if seq.num_output_tokens >= new_tokens:
                sched.finish(seq)


def test_snapshot_position_is_the_last_block_boundary_before_the_final_token():
    assert [snapshot_position(n, 4) for n in (1, 4, 5, 8, 9, 10)] == [0, 0, 4, 4, 8, 8]


def test_lookup_takes_the_deepest_snapshot_and_eviction_is_lru():
    cache = StateCache(capacity=2)
    slots = cache.slots  # its own: the sequences' slots stay dense
    assert cache.store(b"a", 7) == (7, 0) and cache.store(b"b", 7) == (7, 1)
    assert cache.store(b"a", 9) is None  # kept already
    assert cache.lookup([b"a", b"b", b"c"]) == (2, 1) and cache.lookup([b"x", b"a"]) == (2, 0)
    assert cache.lookup([b"c"]) is None
    assert cache.store(b"c", 7) == (7, 1)  # "b" was used least recently: its slot is reused
    assert cache.lookup([b"b"]) is None and len(cache) == 2 and slots.in_use == 2
    cache.clear()
    assert len(cache) == 0 and slots.in_use == 0
    assert StateCache(capacity=0).store(b"a", 1) is None


def test_a_prompt_is_cut_at_its_snapshot_and_the_next_turn_starts_there():
    sched = scheduler(block_size=4, max_num_batched_tokens=64)
    model = SimulatedStates()
    first = Sequence("a", range(10))  # snapshot at 8: chunks [0, 8) and [8, 10)
    sched.add(first)
    out = sched.schedule()
    assert [(c.start, c.num_new_tokens) for c in out.scheduled] == [(0, 8)]
    model.run(out)
    sched.update(out, {})
    out = sched.schedule()
    assert out.snapshot_copies == [(first.state_slot, 0)]  # into snapshot slot 0
    assert [(c.start, c.num_new_tokens) for c in out.scheduled] == [(8, 2)]
    model.run(out)
    sched.update(out, {"a": 50})
    run_to_end(sched, model)
    # the next turn: the conversation so far and a new message
    second = Sequence("b", [*first.token_ids, 51, 52, 53, 54, 55, 56])
    sched.add(second)
    out = sched.schedule()
    assert second.num_cached_tokens == 8 and out.snapshot_restores == [(0, second.state_slot)]
    assert [(c.start, c.num_new_tokens) for c in out.scheduled] == [(8, 8)]  # up to its own snapshot at 16
    model.run(out)
    sched.update(out, {})
    run_to_end(sched, model)
    assert sched.state_slots.in_use == 0 and sched.state_cache.slots.in_use == len(sched.state_cache) == 2


def test_a_hit_without_a_snapshot_starts_from_the_deepest_one_or_from_zero():
    sched = scheduler(block_size=4, snapshots=1, max_num_batched_tokens=64)
    model = SimulatedStates()
    for name, prompt in (("a", range(10)), ("b", range(14))):  # snapshots at 8 then 12 (capacity 1: 8 goes)
        sched.add(Sequence(name, prompt))
        run_to_end(sched, model)
    c = Sequence("c", range(11))  # its KV blocks up to 8 are cached, but no snapshot there any more
    sched.add(c)
    out = sched.schedule()
    assert c.num_cached_tokens == 0 and out.snapshot_restores == [] and out.scheduled[0].start == 0
    model.run(out)


def test_prefix_caching_needs_a_state_cache_and_a_state_cache_needs_state_slots():
    with pytest.raises(ValueError, match="state cache"):
        Scheduler(BlockManager(8, 4), state_slots=StateSlots())
    with pytest.raises(ValueError, match="state slots"):
        Scheduler(BlockManager(8, 4), state_cache=StateCache(2))


def test_forget_cached_gives_the_snapshots_back():
    sched = scheduler()
    model = SimulatedStates()
    sched.add(Sequence("a", range(10)))
    run_to_end(sched, model)
    assert len(sched.state_cache) == 1
    sched.forget_cached()
    assert len(sched.state_cache) == 0 and sched.state_cache.slots.in_use == 0
    assert sched.block_manager.num_cached_blocks == 0 and sched.schedule().snapshot_copies == []


def random_run(seed: int) -> Scheduler:
    """A randomised loop where most prompts continue a finished conversation (so prefixes are shared)."""
    rng = random.Random(seed)
    sched = scheduler(num_blocks=rng.randrange(16, 48), block_size=rng.choice([1, 2, 4, 8]),
                      snapshots=rng.choice([1, 2, 8]), max_num_seqs=rng.choice([2, 4, 64]),
                      max_num_batched_tokens=rng.choice([8, 32, 256]))
    capacity = sched.block_manager.num_blocks * sched.block_manager.block_size

    def new_prompt(finished: list[list[int]]) -> list[int]:
        start = list(rng.choice(finished)) if finished and rng.random() < 0.7 else []
        return (start + [rng.randrange(1000) for _ in range(rng.randrange(1, 12))])[: min(60, capacity - 1)]

    drive_randomly(sched, rng, new_prompt)
    return sched


@pytest.mark.parametrize("seed", range(16))
def test_randomised_loop_with_shared_prefixes_keeps_each_state_in_step(seed):
    sched = random_run(seed)
    assert len(sched.state_cache) <= sched.state_cache.capacity
    assert sched.state_slots.in_use == 0 and sched.state_cache.slots.in_use == len(sched.state_cache)


def test_randomised_loops_start_sequences_from_snapshots():
    assert sum(random_run(seed).block_manager.prefix_cache_hits > 0 for seed in range(16)) >= 8
