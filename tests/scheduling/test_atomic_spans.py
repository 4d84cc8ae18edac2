"""Atomic spans: a chunk never ends inside a span whose tokens attend to each other both ways (a Gemma 3
image), including after a prefix-cache hit that ends inside one, and under a shared token budget."""

from __future__ import annotations

import random

import pytest

from core.scheduling import BlockManager, Scheduler, SchedulerOutput, Sequence
from core.scheduling.scheduler import fit_chunk


def _run_step(sched: Scheduler, out: SchedulerOutput, sampled_token: int = 7) -> None:
    sched.update(out, {s.seq.seq_id: sampled_token for s in out.scheduled if s.samples})


def _chunks(out: SchedulerOutput) -> dict[str, tuple[int, int]]:
    return {s.seq.seq_id: (s.start, s.start + s.num_new_tokens) for s in out.scheduled}


def _cuts_a_span(seq: Sequence, end: int) -> bool:
    return any(start < end < stop for start, stop in seq.atomic_spans)


@pytest.mark.parametrize("spans", [[(3, 3)], [(5, 2)], [(-1, 2)], [(2, 21)], [(2, 6), (5, 8)]],
                         ids=["empty", "reversed", "negative", "past_the_prompt", "overlapping"])
def test_bad_spans_are_refused_by_name(spans):
    with pytest.raises(ValueError, match="atomic_spans"):
        Sequence("s", range(20), atomic_spans=spans)


def test_spans_are_sorted_and_kept_by_forks():
    seq = Sequence("s", range(20), atomic_spans=[(10, 14), (2, 6)])
    assert seq.atomic_spans == ((2, 6), (10, 14))
    assert seq.fork("t").atomic_spans == seq.atomic_spans


@pytest.mark.parametrize(("start", "n", "expected"), [
    (0, 6, 6),    # ends at the span's start
    (0, 8, 6),    # would end inside: moved back to its start
    (0, 10, 10),  # ends at the span's end
    (6, 2, 0),    # starts at the span and cannot hold it: not this step
    (8, 1, 0),    # starts inside (a prefix hit) and falls short of its end
    (8, 2, 2),    # starts inside and finishes it
    (10, 3, 3),   # after the span
    (0, 20, 20),
])
def test_fit_chunk(start, n, expected):
    seq = Sequence("s", range(20), atomic_spans=[(6, 10), (15, 18)])
    assert fit_chunk(seq, start, n) == expected


def test_chunked_prefill_stops_at_an_image_and_computes_it_in_the_next_step():
    sched = Scheduler(BlockManager(16, 4), max_num_batched_tokens=8)
    seq = Sequence("img", range(20), atomic_spans=[(5, 11)])
    sched.add(seq)
    boundaries = []
    while seq.num_computed_tokens < seq.num_prompt_tokens:
        out = sched.schedule()
        boundaries.append(_chunks(out)["img"])
        _run_step(sched, out)
    assert boundaries == [(0, 5), (5, 13), (13, 20)]


def test_a_span_longer_than_the_step_budget_is_refused_at_add():
    sched = Scheduler(BlockManager(16, 4), max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="9 tokens .* exceeds max_num_batched_tokens=8"):
        sched.add(Sequence("big", range(20), atomic_spans=[(2, 11)]))
    assert not sched.has_unfinished
    sched.add(Sequence("fits", range(20), atomic_spans=[(2, 10)]))  # exactly the budget is fine


def test_a_span_shares_the_budget_with_other_requests():
    """The budget left after a text request cuts the image request's chunk back to the image's start."""
    sched = Scheduler(BlockManager(32, 4), max_num_batched_tokens=10)
    sched.add(Sequence("text", range(100, 106)))
    image = Sequence("img", range(12), atomic_spans=[(1, 9)])
    sched.add(image)
    out = sched.schedule()
    assert _chunks(out) == {"text": (0, 6), "img": (0, 1)}
    _run_step(sched, out)
    out = sched.schedule()
    assert _chunks(out) == {"text": (6, 7), "img": (1, 10)}


def _cache_a_prompt_with_an_image(sched: Scheduler, tokens: list[int], span: tuple[int, int]) -> None:
    first = Sequence("first", tokens, cache_keys=[(*span, "image-hash")], atomic_spans=[span])
    sched.add(first)
    while first.num_computed_tokens < first.num_prompt_tokens:
        out = sched.schedule()
        _run_step(sched, out)
    sched.finish(first)


def test_a_prefix_hit_inside_a_span_resumes_with_the_rest_of_the_span_in_one_chunk():
    """Blocks of 4, 12 tokens, span [2, 11): the hit covers [0, 8) (its KV was computed with the whole
    image), so the next chunk must hold [8, 11) at least; with 2 tokens of budget left it waits a step."""
    tokens = list(range(12))
    sched = Scheduler(BlockManager(32, 4), max_num_batched_tokens=12)
    _cache_a_prompt_with_an_image(sched, tokens, (2, 11))
    sched.add(Sequence("text", range(100, 110)))  # takes 10 of the 12 tokens in the first step
    again = Sequence("again", tokens, cache_keys=[(2, 11, "image-hash")], atomic_spans=[(2, 11)])
    sched.add(again)
    out = sched.schedule()
    assert _chunks(out) == {"text": (0, 10)}  # 2 tokens left would end inside the span: FCFS waits
    _run_step(sched, out)
    out = sched.schedule()
    assert _chunks(out)["again"] == (8, 12)
    assert again.num_cached_tokens == 8


def test_a_different_image_misses_the_cache_inside_the_span():
    tokens = list(range(16))
    sched = Scheduler(BlockManager(32, 4), max_num_batched_tokens=12)
    _cache_a_prompt_with_an_image(sched, tokens, (2, 11))
    other = Sequence("other", tokens, cache_keys=[(2, 11, "another-hash")], atomic_spans=[(2, 11)])
    sched.add(other)
    out = sched.schedule()
    assert _chunks(out)["other"] == (0, 12)  # the block [0, 4) overlaps the image: no hit at all
    assert other.num_cached_tokens == 0


@pytest.mark.parametrize("seed", range(6))
def test_randomised_loop_never_ends_a_chunk_inside_a_span(seed):
    """Many requests with images, small budgets, a small cache (preemption) and shared prefixes: every
    chunk ends outside its spans and every request completes."""
    rng = random.Random(seed)
    budget = rng.randrange(8, 20)
    sched = Scheduler(BlockManager(rng.randrange(12, 30), 4), max_num_seqs=rng.randrange(2, 6),
                      max_num_batched_tokens=budget)
    shared = [rng.randrange(1000) for _ in range(12)]
    remaining: dict[str, int] = {}
    for i in range(12):
        tokens = (shared if rng.random() < 0.5 else []) + [rng.randrange(1000) for _ in range(rng.randrange(2, 20))]
        start = rng.randrange(len(tokens))
        span = (start, min(len(tokens), start + rng.randrange(1, budget + 1)))
        sched.add(Sequence(f"r{i}", tokens, cache_keys=[(*span, f"img{i % 3}")], atomic_spans=[span]))
        remaining[f"r{i}"] = rng.randrange(1, 6)
    for _ in range(2000):
        if not sched.has_unfinished:
            break
        out = sched.schedule()
        for s in out.scheduled:
            assert not _cuts_a_span(s.seq, s.start + s.num_new_tokens), (s.seq, s.start, s.num_new_tokens)
        assert out.num_batched_tokens <= budget
        _run_step(sched, out)
        for s in out.scheduled:
            if s.samples and s.seq.status.name == "RUNNING":
                remaining[s.seq.seq_id] -= 1
                if remaining[s.seq.seq_id] == 0:
                    sched.finish(s.seq)
        for seq in out.too_long:
            remaining.pop(seq.seq_id)
    assert not sched.has_unfinished
