"""Speculative decoding in the scheduler, over a simulated KV cache: drafts ride in a decoding chunk, only
accepted tokens count as computed, rejected drafts' blocks are released, the prefix cache registers only
blocks of accepted tokens, drafts never preempt, and the output equals decoding one token at a time."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from core.scheduling import BlockManager, Scheduler, SchedulerOutput, Sequence, SequenceStatus
from core.scheduling.speculation import verified_tokens

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib leaves sys.path alone
from test_scheduler import check_invariants, fake_token, reference_output  # noqa: E402


class SpeculatingEngine:
    """An engine loop over a simulated KV cache (as test_scheduler.FakeEngine) whose decoding rows verify
    drafts: each draft is the true next token with probability `hit_rate`, else a wrong one. Every chunk
    writes (token) into its slots, drafts included; before sampling, every position up to the chunk's end
    must read back the row's own token or draft."""

    def __init__(self, num_blocks, block_size, k=4, hit_rate=0.7, seed=0, **scheduler_kwargs):
        self.bm = BlockManager(num_blocks, block_size)
        self.sched = Scheduler(self.bm, **scheduler_kwargs)
        self.k, self.hit_rate, self.rng = k, hit_rate, random.Random(seed)
        self.kv: dict[int, list] = {}
        self.max_tokens: dict[str, int] = {}
        self.origin: dict[str, int] = {}
        self.finished: dict[str, Sequence] = {}
        self.proposed = self.accepted = self.preemptions = 0

    def add(self, seq: Sequence, max_tokens: int) -> None:
        self.max_tokens[seq.seq_id], self.origin[seq.seq_id] = max_tokens, seq.num_tokens
        self.sched.add(seq)

    def drafts(self) -> dict[str, list[int]]:
        out = {}
        for seq in self.sched.running:
            left = self.max_tokens[seq.seq_id] - (seq.num_tokens - self.origin[seq.seq_id])
            context, draft = list(seq.token_ids), []
            for _ in range(min(self.k, left - 1)):
                true = fake_token(seq.seq_id, context)
                token = true if self.rng.random() < self.hit_rate else true + 1
                draft.append(token)
                context.append(token)
            if draft:
                out[seq.seq_id] = draft
        return out

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule(self.drafts())
        self.preemptions += len(out.preempted)
        sampled = {}
        for s in out.scheduled:
            assert s.num_new_tokens <= s.seq.num_tokens - s.start + len(s.draft_token_ids)
            tokens = s.seq.token_ids[: s.start] + s.token_ids
            self._write(s.seq, s.start, tokens)
            self._check(s.seq, tokens)
            if not s.samples:
                continue
            if not s.draft_token_ids:
                sampled[s.seq.seq_id] = fake_token(s.seq.seq_id, s.seq.token_ids)
                continue
            base = s.seq.token_ids
            drafts = s.draft_token_ids
            target = [fake_token(s.seq.seq_id, base + list(drafts[:j])) for j in range(len(drafts) + 1)]
            kept = verified_tokens(drafts, target)
            self.proposed += len(drafts)
            self.accepted += len(kept) - 1
            sampled[s.seq.seq_id] = kept[: self._left(s.seq)]
        self.sched.update(out, sampled)
        for s in out.scheduled:
            seq = s.seq
            if seq.status is SequenceStatus.RUNNING and self._left(seq) <= 0:
                self.sched.finish(seq)
                self.finished[seq.seq_id] = seq
        return out

    def _left(self, seq: Sequence) -> int:
        return self.max_tokens[seq.seq_id] - (seq.num_tokens - self.origin[seq.seq_id])

    def _write(self, seq: Sequence, start: int, tokens: list[int]) -> None:
        bs = self.bm.block_size
        for pos in range(start, len(tokens)):
            self.kv.setdefault(seq.block_table[pos // bs], [None] * bs)[pos % bs] = tokens[pos]

    def _check(self, seq: Sequence, tokens: list[int]) -> None:
        bs = self.bm.block_size
        for pos, token in enumerate(tokens):
            assert self.kv[seq.block_table[pos // bs]][pos % bs] == token, f"{seq.seq_id}: wrong KV at {pos}"

    def run(self, max_steps=20_000) -> None:
        steps = 0
        while self.sched.has_unfinished:
            self.step()
            check_invariants(self.sched)
            for seq in self.sched.running:  # a table covers exactly the computed KV between steps
                assert len(seq.block_table) == self.bm.num_blocks_for(seq.num_computed_tokens)
            steps += 1
            assert steps < max_steps


def test_a_verified_chunk_counts_only_accepted_tokens_as_computed():
    bm = BlockManager(16, 4)
    sched = Scheduler(bm)
    seq = Sequence("a", [1, 2, 3, 4, 5, 6])
    sched.add(seq)
    sched.update(sched.schedule(), {"a": 7})  # prefill: 6 computed, 7 tokens
    out = sched.schedule({"a": [8, 9, 10, 11, 12, 13]})
    (chunk,) = out.scheduled
    assert chunk.draft_token_ids == (8, 9, 10, 11, 12, 13) and chunk.num_new_tokens == 7
    assert chunk.token_ids == [7, 8, 9, 10, 11, 12, 13] and chunk.samples
    assert len(seq.block_table) == 4  # 13 positions: blocks for the drafts too
    sched.update(out, {"a": [8, 9, 99]})  # two drafts accepted, then the target's own token
    assert seq.token_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9, 99]
    assert seq.num_computed_tokens == 9
    assert len(seq.block_table) == 3 and bm.num_used_blocks == 3  # the drafts-only block went back
    assert bm.num_cached_blocks == 2  # [1..4], [5..8]: full of accepted tokens; [9, ...] is not full


def _decoding(num_blocks: int) -> tuple[BlockManager, Scheduler, Sequence]:
    """A scheduler over blocks of 4 whose one sequence, [1, 2, 3], is prefilled and sampled 4."""
    bm = BlockManager(num_blocks, 4)
    sched = Scheduler(bm)
    seq = Sequence("a", [1, 2, 3])
    sched.add(seq)
    sched.update(sched.schedule(), {"a": 4})
    return bm, sched, seq


def test_the_prefix_cache_never_registers_a_block_of_rejected_drafts():
    bm, sched, seq = _decoding(16)
    out = sched.schedule({"a": [5, 6, 7, 8]})  # positions 4..7 would fill block 1 with drafts
    sched.update(out, {"a": [50]})  # the first draft is rejected
    assert seq.token_ids == [1, 2, 3, 4, 50] and seq.num_computed_tokens == 4
    assert bm.num_cached_blocks == 1  # [1, 2, 3, 4] only
    sched.finish(seq)
    other = Sequence("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert len(bm.match_prefix(other)) == 1  # [5, 6, 7, 8] of the rejected drafts is not cached


def test_drafts_are_cut_to_the_token_budget():
    sched = Scheduler(BlockManager(8, 4), max_num_batched_tokens=3)
    a = Sequence("a", [1, 2, 3])
    sched.add(a)
    sched.update(sched.schedule(), {"a": 9})
    out = sched.schedule({"a": [1, 1, 1, 1]})
    assert out.scheduled[0].draft_token_ids == (1, 1)  # 1 + 2 tokens fill the budget of 3


def test_drafts_without_free_blocks_are_dropped_and_never_preempt():
    bm = BlockManager(4, 4)
    sched = Scheduler(bm)
    a, b = Sequence("a", [1, 2, 3]), Sequence("b", [4, 5, 6])
    sched.add(a)
    sched.add(b)
    sched.update(sched.schedule(), {"a": 7, "b": 8})  # one block each, two free
    out = sched.schedule({"a": [1, 1, 1, 1, 1], "b": [2, 2]})  # a's drafts take both free blocks
    by_id = {s.seq.seq_id: s for s in out.scheduled}
    assert by_id["a"].draft_token_ids == (1, 1, 1, 1, 1) and by_id["b"].draft_token_ids == ()
    assert not out.preempted and bm.num_free_blocks == 0
    sched.update(out, {"a": [5], "b": 6})
    assert bm.num_free_blocks == 2 and len(a.block_table) == 1


def test_a_plain_token_for_a_verified_chunk_accepts_no_draft():
    _, sched, seq = _decoding(8)
    sched.update(sched.schedule({"a": [5, 6]}), {"a": 7})
    assert seq.token_ids == [1, 2, 3, 4, 7] and seq.num_computed_tokens == 4


@pytest.mark.parametrize("hit_rate", [0.0, 0.6, 1.0])
def test_speculating_loop_output_equals_one_token_at_a_time(hit_rate):
    rng = random.Random(7)
    shared = [rng.randrange(50_000) for _ in range(23)]
    engine = SpeculatingEngine(20, 4, k=5, hit_rate=hit_rate, seed=3, max_num_batched_tokens=24)
    prompts = {f"s{i}": shared[: rng.randrange(5, 23)] + [rng.randrange(50_000) for _ in range(rng.randrange(1, 9))]
               for i in range(12)}
    wanted = {sid: rng.randrange(1, 30) for sid in prompts}
    for sid, prompt in prompts.items():
        engine.add(Sequence(sid, prompt), wanted[sid])
    engine.run()
    for sid, prompt in prompts.items():
        assert engine.finished[sid].output_token_ids == reference_output(sid, prompt, wanted[sid]), sid
    assert engine.bm.num_used_blocks == 0
    assert engine.preemptions > 0  # the budget was small enough to preempt
    if hit_rate:
        assert engine.accepted > 0
