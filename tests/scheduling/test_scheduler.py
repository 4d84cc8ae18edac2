"""Scheduler: continuous batching, chunked prefill, preemption, abort, fork, randomised engine loops."""

from __future__ import annotations

import random
import zlib
from array import array
from collections import Counter

import pytest

from core.scheduling import BlockManager, Scheduler, SchedulerOutput, Sequence, SequenceStatus


def fake_token(seq_id: str, context: list[int]) -> int:
    """The fake model's deterministic sample: a function of the sequence id and its whole context."""
    return zlib.crc32(array("q", context).tobytes(), zlib.crc32(seq_id.encode())) % 50_000


def reference_output(seq_id: str, context: list[int], max_tokens: int) -> list[int]:
    tokens = list(context)
    for _ in range(max_tokens):
        tokens.append(fake_token(seq_id, tokens))
    return tokens[len(context) :]


class FakeEngine:
    """An engine loop over a simulated KV cache.

    Every scheduled chunk writes ``(token, cache key)`` into the slots its block
    table maps it to; before sampling, every position of the context is read
    back through the block table and must hold the sequence's own token: a
    wrongly shared, evicted, or uncopied block shows up as a mismatch.
    """

    def __init__(self, num_blocks, block_size, prefix_caching=True, **scheduler_kwargs):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching)
        self.sched = Scheduler(self.bm, **scheduler_kwargs)
        self.kv: dict[int, list] = {}
        self.max_tokens: dict[str, int] = {}
        # Length of each sequence when it entered the engine: max_tokens counts from there.
        self.origin: dict[str, int] = {}
        self.finished: dict[str, Sequence] = {}
        self.too_long: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self.num_steps = 0

    def add(self, seq: Sequence, max_tokens: int) -> None:
        self.max_tokens[seq.seq_id] = max_tokens
        self.origin[seq.seq_id] = seq.num_tokens
        self.sched.add(seq)

    def fork(self, parent: Sequence, child_id: str, max_tokens: int) -> Sequence:
        child = parent.fork(child_id)
        self.max_tokens[child_id] = max_tokens
        self.origin[child_id] = child.num_tokens
        self.sched.fork(parent, child)
        return child

    def step(self, between=None) -> SchedulerOutput:
        out = self.sched.schedule()
        self.num_steps += 1
        self.num_preemptions += len(out.preempted)
        self.too_long.update((s.seq_id, s) for s in out.too_long)
        self._check_output(out)
        for src, dst in out.block_copies:
            self.kv[dst] = list(self.kv[src])
        sampled = {}
        for s in out.scheduled:
            self._write_kv(s.seq, s.start, s.start + s.num_new_tokens)
            self._check_kv(s.seq, s.start + s.num_new_tokens)
            if s.samples:
                sampled[s.seq.seq_id] = fake_token(s.seq.seq_id, s.seq.token_ids)
        if between is not None:
            between(out)  # e.g. aborts arriving while the model runs
        self.sched.update(out, sampled)
        for s in out.scheduled:
            seq = s.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if seq.num_tokens - self.origin[seq.seq_id] >= self.max_tokens[seq.seq_id]:
                self.sched.finish(seq)
                self.finished[seq.seq_id] = seq
        return out

    def run(self, max_steps=10_000) -> None:
        while self.sched.has_unfinished:
            self.step()
            check_invariants(self.sched)
            assert self.num_steps < max_steps, "engine loop made no progress"

    def _check_output(self, out: SchedulerOutput) -> None:
        ids = [s.seq.seq_id for s in out.scheduled]
        assert len(ids) == len(set(ids)), "a sequence was scheduled twice in one step"
        assert out.num_batched_tokens <= self.sched.max_num_batched_tokens
        assert len(out.scheduled) <= self.sched.max_num_seqs
        for s in out.scheduled:
            assert s.num_new_tokens > 0
            assert s.start + s.num_new_tokens <= s.seq.num_tokens
            assert len(s.seq.block_table) * self.bm.block_size >= s.start + s.num_new_tokens

    def _entry(self, seq: Sequence, pos: int):
        key = next((k for start, end, k in seq.cache_keys if start <= pos < end), None)
        return (seq.token_ids[pos], key)

    def _write_kv(self, seq: Sequence, start: int, end: int) -> None:
        bs = self.bm.block_size
        for pos in range(start, end):
            self.kv.setdefault(seq.block_table[pos // bs], [None] * bs)[pos % bs] = self._entry(seq, pos)

    def _check_kv(self, seq: Sequence, end: int) -> None:
        bs = self.bm.block_size
        for pos in range(end):
            got = self.kv.get(seq.block_table[pos // bs], [None] * bs)[pos % bs]
            assert got == self._entry(seq, pos), f"{seq.seq_id}: wrong KV at position {pos}"


def check_invariants(sched: Scheduler) -> None:
    """Ref counts match the tables, accounting adds up, every sequence is in exactly one queue."""
    bm = sched.block_manager
    holders: Counter[int] = Counter()
    for seq in sched.running:
        assert seq.status is SequenceStatus.RUNNING
        assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens
        holders.update(seq.block_table)
    for seq in sched.waiting:
        assert seq.status is SequenceStatus.WAITING
        assert seq.block_table == [] and seq.num_computed_tokens == 0
    for block_id in range(bm.num_blocks):
        assert bm.ref_count(block_id) == holders[block_id], f"block {block_id}"
    assert bm.num_used_blocks == len(holders)
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_blocks
    queued = [s.seq_id for s in sched.running] + [s.seq_id for s in sched.waiting]
    assert len(queued) == len(set(queued)) == sched.num_running + sched.num_waiting
    assert sched.has_unfinished == bool(queued)
    assert [s.arrival_order for s in sched.running] == sorted(s.arrival_order for s in sched.running)


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(50_000) for _ in range(n)]


# ---------------------------------------------------------------- basic flow


def test_continuous_batching_a_request_added_mid_flight_runs_next_step():
    eng = FakeEngine(num_blocks=64, block_size=4)
    a = Sequence("a", range(10))
    eng.add(a, max_tokens=20)
    out = eng.step()
    assert [(s.seq.seq_id, s.num_new_tokens, s.samples) for s in out.scheduled] == [("a", 10, True)]
    eng.step()
    b = Sequence("b", range(100, 107))
    eng.add(b, max_tokens=3)
    out = eng.step()
    assert [(s.seq.seq_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 7)]
    assert eng.sched.num_running == 2 and eng.sched.num_waiting == 0
    eng.run()
    assert a.output_token_ids == reference_output("a", list(range(10)), 20)
    assert b.output_token_ids == reference_output("b", list(range(100, 107)), 3)
    assert eng.bm.num_free_blocks == 64


def test_chunked_prefill_respects_the_token_budget():
    eng = FakeEngine(num_blocks=128, block_size=16, max_num_batched_tokens=64)
    a = Sequence("a", range(20))
    eng.add(a, max_tokens=50)
    eng.step()
    long = Sequence("long", range(1000, 1200))
    eng.add(long, max_tokens=2)
    chunks = []
    while long.num_output_tokens == 0:
        out = eng.step()
        assert out.num_batched_tokens <= 64
        chunks.append([(s.seq.seq_id, s.num_new_tokens, s.samples) for s in out.scheduled])
    # The decode goes first each step; the long prompt fills the rest of the budget.
    assert chunks == [
        [("a", 1, True), ("long", 63, False)],
        [("a", 1, True), ("long", 63, False)],
        [("a", 1, True), ("long", 63, False)],
        [("a", 1, True), ("long", 11, True)],
    ]
    eng.run()
    assert long.output_token_ids == reference_output("long", list(range(1000, 1200)), 2)


def test_max_num_seqs_limits_the_batch():
    eng = FakeEngine(num_blocks=128, block_size=4, max_num_seqs=3)
    for i in range(5):
        eng.add(Sequence(f"s{i}", range(i * 10, i * 10 + 5)), max_tokens=4)
    out = eng.step()
    assert [s.seq.seq_id for s in out.scheduled] == ["s0", "s1", "s2"]
    assert eng.sched.num_waiting == 2
    eng.run()
    assert len(eng.finished) == 5


def test_add_rejects_a_prompt_that_can_never_fit():
    sched = Scheduler(BlockManager(num_blocks=4, block_size=4))
    sched.add(Sequence("fits", range(16)))
    with pytest.raises(ValueError, match="too-big"):
        sched.add(Sequence("too-big", range(17)))
    with pytest.raises(ValueError, match="fits"):
        sched.add(Sequence("fits", range(3)))


def test_a_sequence_that_outgrows_the_whole_cache_is_finished_as_too_long():
    eng = FakeEngine(num_blocks=4, block_size=4)
    seq = Sequence("grow", range(10))
    eng.add(seq, max_tokens=100)
    eng.run()
    assert eng.too_long == {"grow": seq} and seq.status is SequenceStatus.FINISHED
    assert seq.num_tokens == 17  # the 16 tokens that fit, plus the last one sampled
    assert seq.output_token_ids == reference_output("grow", list(range(10)), 7)
    assert eng.bm.num_free_blocks == 4


def test_update_requires_a_token_for_every_sampling_chunk():
    sched = Scheduler(BlockManager(num_blocks=8, block_size=4))
    sched.add(Sequence("a", range(5)))
    out = sched.schedule()
    with pytest.raises(KeyError, match="a"):
        sched.update(out, {})


# ---------------------------------------------------------------- prefix cache


@pytest.mark.parametrize(("suffix", "expected"), [(5, 256), (1, 256), (0, 240), (16, 256), (17, 272)])
def test_prefix_cache_hit_through_the_scheduler(suffix, expected):
    rng = random.Random(1)
    shared = prompt(rng, 256)
    eng = FakeEngine(num_blocks=64, block_size=16, max_num_batched_tokens=4096)
    first = Sequence("first", shared + prompt(rng, 30))
    eng.add(first, max_tokens=1)
    eng.run()
    second_prompt = shared + first.token_ids[256 : 256 + suffix]
    second = Sequence("second", second_prompt)
    eng.add(second, max_tokens=2)
    out = eng.step()
    assert second.num_cached_tokens == expected
    assert [(s.seq.seq_id, s.start, s.num_new_tokens) for s in out.scheduled] == [
        ("second", expected, len(second_prompt) - expected)
    ]
    eng.run()
    assert second.output_token_ids == reference_output("second", second_prompt, 2)
    assert eng.bm.prefix_cache_hits == expected
    assert eng.bm.num_free_blocks == 64


def test_same_tokens_with_different_image_keys_do_not_share_blocks():
    eng = FakeEngine(num_blocks=64, block_size=4)
    tokens = list(range(40))
    a = Sequence("a", tokens, cache_keys=[(8, 24, "image-1")])
    eng.add(a, max_tokens=1)
    eng.run()
    b = Sequence("b", tokens, cache_keys=[(8, 24, "image-2")])
    c = Sequence("c", tokens, cache_keys=[(8, 24, "image-1")])
    eng.add(b, max_tokens=1)
    eng.add(c, max_tokens=1)
    eng.run()  # the KV check would catch b reading a's image KV
    assert b.num_cached_tokens == 8 and c.num_cached_tokens == 36


# ---------------------------------------------------------------- abort / finish


def test_abort_waiting_and_running_frees_every_block():
    eng = FakeEngine(num_blocks=16, block_size=4, max_num_seqs=2)
    for i in range(4):
        eng.add(Sequence(f"s{i}", range(i * 100, i * 100 + 9)), max_tokens=50)
    eng.step()
    assert eng.sched.num_running == 2 and eng.bm.num_used_blocks > 0
    assert eng.sched.abort("s3").seq_id == "s3"  # waiting
    assert eng.sched.abort("s0").seq_id == "s0"  # running
    assert eng.sched.abort("nope") is None
    check_invariants(eng.sched)
    eng.step()
    assert eng.sched.abort("s1") is not None and eng.sched.abort("s2") is not None
    assert not eng.sched.has_unfinished and eng.bm.num_free_blocks == 16


def test_abort_between_schedule_and_update_is_skipped():
    eng = FakeEngine(num_blocks=16, block_size=4)
    a, b = Sequence("a", range(6)), Sequence("b", range(50, 56))
    eng.add(a, max_tokens=5)
    eng.add(b, max_tokens=5)
    eng.step(between=lambda out: eng.sched.abort("a"))
    assert a.status is SequenceStatus.FINISHED and a.num_output_tokens == 0
    assert b.num_output_tokens == 1
    eng.run()
    assert b.output_token_ids == reference_output("b", list(range(50, 56)), 5)
    assert eng.bm.num_free_blocks == 16


# ---------------------------------------------------------------- preemption


def test_preemption_recomputes_the_most_recent_arrival_and_keeps_its_output():
    eng = FakeEngine(num_blocks=4, block_size=4)
    old, new = Sequence("old", range(7)), Sequence("new", range(100, 107))
    eng.add(old, max_tokens=6)
    eng.add(new, max_tokens=6)
    eng.step()  # both prefilled: 2 blocks each, the cache is full
    late = Sequence("late", range(200, 203))
    eng.add(late, max_tokens=2)
    eng.step()  # both decode their 8th token into their second block; "late" cannot start
    out = eng.step()  # "old" needs a third block: "new" is preempted
    assert out.preempted == [new] and [s.seq for s in out.scheduled] == [old]
    assert new.status is SequenceStatus.WAITING and new.num_computed_tokens == 0
    assert new.num_output_tokens == 2 and list(eng.sched.waiting) == [new, late]  # back at the front
    eng.run()
    assert old.output_token_ids == reference_output("old", list(range(7)), 6)
    assert new.output_token_ids == reference_output("new", list(range(100, 107)), 6)


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("num_blocks", [7, 9, 12])
def test_tiny_cache_produces_the_same_outputs_as_a_large_one(prefix_caching, num_blocks):
    def requests():
        rng = random.Random(7)
        system = prompt(rng, 6)
        return [
            (Sequence(f"r{i}", system + prompt(rng, rng.randrange(1, 10))), rng.randrange(1, 13))
            for i in range(12)
        ]

    outputs = {}
    for blocks in (num_blocks, 1000):
        eng = FakeEngine(blocks, block_size=4, prefix_caching=prefix_caching, max_num_batched_tokens=32)
        for seq, max_tokens in requests():
            eng.add(seq, max_tokens)
        eng.run()
        assert not eng.too_long and eng.bm.num_free_blocks == blocks
        outputs[blocks] = {sid: seq.output_token_ids for sid, seq in eng.finished.items()}
        if blocks == num_blocks:
            assert eng.num_preemptions > 0
    assert outputs[num_blocks] == outputs[1000]
    assert len(outputs[1000]) == 12


# ---------------------------------------------------------------- fork


def test_fork_copies_come_with_the_next_step_and_both_streams_complete():
    eng = FakeEngine(num_blocks=32, block_size=4)
    parent = Sequence("p", range(10))
    eng.add(parent, max_tokens=6)
    eng.step()  # prefill 10 tokens; the third block is partial
    children = [eng.fork(parent, f"p.{i}", max_tokens=6) for i in range(2)]
    check_invariants(eng.sched)
    out = eng.step()
    assert len(out.block_copies) == 2
    assert {dst for _, dst in out.block_copies} == {c.block_table[2] for c in children}
    assert [s.seq.seq_id for s in out.scheduled] == ["p", "p.0", "p.1"]
    assert all(s.num_new_tokens == 1 for s in out.scheduled)
    eng.run()
    first = parent.output_token_ids[:1]
    assert parent.output_token_ids == reference_output("p", list(range(10)), 6)
    for child in children:
        context = list(range(10)) + first
        assert child.output_token_ids == first + reference_output(child.seq_id, context, 6)
    assert eng.bm.num_free_blocks == 32


# ---------------------------------------------------------------- randomised


class RandomWorkload:
    """Random arrivals (shared prompt templates, some with image keys), aborts and forks."""

    def __init__(self, seed: int) -> None:
        rng = self.rng = random.Random(seed)
        block_size = rng.choice([1, 2, 4, 16])
        num_blocks = rng.randrange(64, 160) // block_size + rng.randrange(4, 12)
        self.eng = FakeEngine(
            num_blocks,
            block_size,
            prefix_caching=rng.random() < 0.8,
            max_num_seqs=rng.choice([2, 4, 16, 256]),
            max_num_batched_tokens=rng.choice([8, 32, 64, 512]),
        )
        self.capacity = num_blocks * block_size
        self.templates = [prompt(rng, rng.randrange(1, 40)) for _ in range(3)]
        self.aborted: set[str] = set()
        self.counter = 0

    def new_request(self) -> None:
        rng = self.rng
        self.counter += 1
        tokens = list(rng.choice(self.templates)) + prompt(rng, rng.randrange(0, 20))
        tokens = tokens[: self.capacity] or [1]
        keys = []
        if rng.random() < 0.3 and len(tokens) > 4:
            start = rng.randrange(len(tokens) - 2)
            keys = [(start, start + rng.randrange(1, 8), rng.choice(["img-a", "img-b"]))]
        seq = Sequence(f"r{self.counter}", tokens, cache_keys=keys)
        self.eng.add(seq, max_tokens=rng.randrange(1, 30))

    def abort_one(self, _out=None) -> None:
        live = list(self.eng.sched.running) + list(self.eng.sched.waiting)
        if live:
            victim = self.rng.choice(live)
            assert self.eng.sched.abort(victim.seq_id) is victim
            self.aborted.add(victim.seq_id)

    def fork_one(self, step: int) -> None:
        parents = [s for s in self.eng.sched.running if s.num_output_tokens]
        if parents:
            parent = self.rng.choice(parents)
            self.eng.fork(parent, f"{parent.seq_id}.f{step}", max_tokens=self.rng.randrange(1, 10))

    def step(self, step: int) -> None:
        rng = self.rng
        for _ in range(rng.choice([0, 0, 0, 1, 1, 2])):
            self.new_request()
        abort_now = rng.random() < 0.05
        self.eng.step(between=self.abort_one if abort_now and rng.random() < 0.5 else None)
        if abort_now and rng.random() < 0.5:
            self.abort_one()
        if rng.random() < 0.05:
            self.fork_one(step)

    def check_outcome(self) -> None:
        eng = self.eng
        assert eng.bm.num_free_blocks == eng.bm.num_blocks and eng.bm.num_used_blocks == 0
        done = set(eng.finished) | set(eng.too_long) | self.aborted
        assert done == set(eng.origin), "a request was lost"
        assert not (set(eng.finished) | set(eng.too_long)) & self.aborted
        for seq_id, seq in eng.finished.items():
            assert seq.status is SequenceStatus.FINISHED
            start = eng.origin[seq_id]
            assert seq.num_tokens - start == eng.max_tokens[seq_id], "a token was lost or duplicated"
            expected = reference_output(seq_id, seq.token_ids[:start], seq.num_tokens - start)
            assert seq.token_ids[start:] == expected
        for seq in eng.too_long.values():
            assert seq.num_tokens > self.capacity


@pytest.mark.parametrize("seed", range(24))
def test_randomised_engine_loop_keeps_invariants(seed):
    work = RandomWorkload(seed)
    for step in range(300):
        work.step(step)
        check_invariants(work.eng.sched)
    work.eng.run()  # drain: no more arrivals
    work.check_outcome()
