"""Continuous batching with chunked prefill and preemption by recompute."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Mapping
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field

from core.scheduling.block_manager import BlockManager
from core.scheduling.sequence import Sequence, SequenceStatus
from core.scheduling.state_cache import StateCache, snapshot_position
from core.scheduling.state_slots import StateSlots


def _arrival(seq: Sequence) -> int:
    return seq.arrival_order


def fit_chunk(seq: Sequence, start: int, n: int) -> int:
    """How many of the ``n`` tokens from ``start`` the chunk may take so it ends outside ``seq``'s atomic spans.

    A chunk that would end inside a span stops at the span's start; if it
    starts inside that span (after a prefix-cache hit), it cannot be cut, and
    0 means "not this step": the budget left is short of the span's end.
    """
    end = start + n
    for span_start, span_end in seq.atomic_spans:
        if span_start < end < span_end:
            return max(span_start - start, 0)
        if span_start >= end:
            break
    return n


@dataclass
class ScheduledSequence:
    """A chunk of ``num_new_tokens`` tokens of ``seq`` to run this step.

    The chunk covers ``seq.token_ids[start:start + num_new_tokens]``;
    ``start`` and ``samples`` are fixed when the chunk is scheduled, so they
    stay right after :meth:`Scheduler.update` advanced the sequence.

    A speculating chunk also carries ``draft_token_ids``: proposed tokens
    after the sequence's last one, counted in ``num_new_tokens`` (they are
    query rows of the step), verified by the model and never part of
    ``seq.token_ids`` until accepted (see ``Scheduler.update``).
    """

    seq: Sequence
    num_new_tokens: int
    start: int = field(init=False)
    samples: bool = field(init=False)
    """This chunk reaches the end of the tokens: the model must sample a token for it."""
    draft_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.start = self.seq.num_computed_tokens
        self.samples = self.start + self.num_new_tokens >= self.seq.num_tokens

    @property
    def token_ids(self) -> list[int]:
        """The tokens of this chunk (drafts last)."""
        if not self.draft_token_ids:  # every chunk of every step: no second copy
            return self.seq.token_ids[self.start : self.start + self.num_new_tokens]
        real = self.num_new_tokens - len(self.draft_token_ids)
        return [*self.seq.token_ids[self.start : self.start + real], *self.draft_token_ids]


@dataclass
class SchedulerOutput:
    """What one step runs.

    ``block_copies`` are ``(src, dst)`` KV block copies (from forks) that the
    model runner must do before the forward.  ``preempted`` sequences lost
    their KV and went back to the waiting queue (they keep their output).
    ``too_long`` sequences outgrew the whole KV cache: the scheduler finished
    them and freed their blocks; the engine reports them as length-stopped.
    ``state_copies`` are ``(src, dst)`` recurrent-state slot copies (forks of
    a model with recurrent layers), also done before the forward. With a state
    cache, ``snapshot_copies`` (a sequence's slot -> a snapshot slot: states
    kept) come first, then ``snapshot_restores`` (a snapshot slot -> a
    sequence's slot: prefix-cache hits), which may read a snapshot just kept.
    """

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    too_long: list[Sequence] = field(default_factory=list)
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    snapshot_copies: list[tuple[int, int]] = field(default_factory=list)
    snapshot_restores: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        """Tokens run this step."""
        return sum(s.num_new_tokens for s in self.scheduled)

class Scheduler:
    """Decides, step by step, which tokens of which sequences the model computes.

    Engine loop: ``out = schedule()``; run the model on ``out.scheduled``;
    sample one token for each chunk whose ``samples`` is true;
    ``update(out, {seq_id: token})``; then ``finish`` the sequences that stop.

    A chunk never ends strictly inside one of its sequence's
    ``atomic_spans`` (:func:`fit_chunk`): it stops at the span's start, or,
    when it starts inside the span, it runs to the span's end or waits for a
    step with enough budget.  A chunk can start inside a span only after a
    prefix-cache hit (or a fork) ended there, and that is sound: a cached
    block is keyed on the span's content (``cache_keys``) and its KV was
    computed by a chunk that held the whole span, so it is exactly what this
    sequence would compute; the tokens left of the span are then computed
    together and see the cached ones.  ``add`` refuses a span longer than
    ``max_num_batched_tokens``, so every span fits one step.
    """

    def __init__(
        self, block_manager: BlockManager, max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
        state_slots: StateSlots | None = None, state_cache: StateCache | None = None,
    ) -> None:
        if max_num_seqs <= 0 or max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if state_slots is not None and block_manager.enable_prefix_caching and state_cache is None:
            raise ValueError("a model with recurrent state cannot start a sequence from cached KV blocks alone: "
                             "give a state cache or turn prefix caching off")
        if state_cache is not None and (state_slots is None or not block_manager.enable_prefix_caching):
            raise ValueError("a state cache keeps recurrent states (state slots) with prefix caching on")
        self.block_manager = block_manager
        self.state_slots = state_slots  # a model with recurrent layers: one slot per running sequence
        self.state_cache = state_cache  # and its prefix cache: state snapshots at block boundaries
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        # Sorted by arrival: scheduled oldest first, preempted newest first (from the end).
        self.running: list[Sequence] = []
        self._seqs: dict[str, Sequence] = {}
        self._pending_copies: list[tuple[int, int]] = []
        self._pending_state_copies: list[tuple[int, int]] = []
        self._snapshot_copies: dict[int, int] = {}  # snapshot slot -> the slot its state comes from

    # ---------------------------------------------------------------- queues

    @property
    def has_unfinished(self) -> bool:
        """Some sequence is waiting or running."""
        return bool(self._seqs)

    @property
    def num_running(self) -> int:
        """Sequences holding (or about to hold) KV blocks."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Sequences queued for their (re)start."""
        return len(self.waiting)

    def get(self, seq_id: str) -> Sequence | None:
        """The unfinished sequence with this id, if any."""
        return self._seqs.get(seq_id)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (it joins the batch at the next ``schedule``)."""
        if seq.seq_id in self._seqs:
            raise ValueError(f"sequence {seq.seq_id!r} is already scheduled")
        self.check(seq)
        seq.status = SequenceStatus.WAITING
        self._seqs[seq.seq_id] = seq
        self.waiting.append(seq)

    def check(self, seq: Sequence) -> None:
        """Raise ``ValueError`` if ``add`` would refuse ``seq`` as one that can never run."""
        if self._exceeds_cache(seq):
            bm = self.block_manager
            raise ValueError(
                f"sequence {seq.seq_id!r}: its {seq.num_tokens} tokens can never fit in the KV cache "
                f"({bm.num_blocks} blocks of {bm.block_size} tokens)"
            )
        longest = max((end - start for start, end in seq.atomic_spans), default=0)
        if longest > self.max_num_batched_tokens:
            raise ValueError(
                f"sequence {seq.seq_id!r}: a span of {longest} tokens that must be computed in one step "
                f"(e.g. an image) exceeds max_num_batched_tokens={self.max_num_batched_tokens}; raise it"
            )

    def abort(self, seq_id: str) -> Sequence | None:
        """Drop a waiting or running sequence at once, freeing its blocks."""
        seq = self._seqs.get(seq_id)
        if seq is not None:
            self.finish(seq)
        return seq

    def finish(self, seq: Sequence) -> None:
        """Mark ``seq`` finished and free its blocks (no-op if it already is)."""
        if self._seqs.get(seq.seq_id) is not seq:
            return
        del self._seqs[seq.seq_id]
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._free(seq)
        seq.status = SequenceStatus.FINISHED

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start ``child`` (e.g. ``parent.fork(new_id)``) from ``parent``'s computed KV.

        The child joins the running batch (even beyond ``max_num_seqs``); the
        block copies it needs come with the next ``schedule`` output.
        """
        if parent.status is not SequenceStatus.RUNNING or self._seqs.get(parent.seq_id) is not parent:
            raise ValueError(f"fork parent {parent.seq_id!r} is not running")
        if child.seq_id in self._seqs:
            raise ValueError(f"sequence {child.seq_id!r} is already scheduled")
        self._pending_copies.extend(self.block_manager.fork(parent, child))
        if self.state_slots is not None:
            slot = self.state_slots.take(child)
            if child.num_computed_tokens == parent.num_computed_tokens:
                self._pending_state_copies.append((parent.state_slot, slot))
            else:  # no block for a copy of the parent's partial block: its state is not the child's
                self.block_manager.free(child)  # the child recomputes from its first token
        child.status = SequenceStatus.RUNNING
        self._seqs[child.seq_id] = child
        bisect.insort(self.running, child, key=_arrival)

    # -------------------------------------------------------------- schedule

    def schedule(self, drafts: Mapping[str, SequenceABC[int]] | None = None) -> SchedulerOutput:
        """Pick this step's chunks: running sequences first, then waiting ones FCFS.

        ``drafts`` maps a running sequence's id to tokens proposed after its
        last one (speculative decoding); a sequence that decodes this step
        verifies them in its chunk (``draft_token_ids``) as far as the token
        budget and free blocks allow. Drafts never preempt anyone: without
        room they are dropped and the sequence decodes one token.
        """
        out = SchedulerOutput(block_copies=self._pending_copies, state_copies=self._pending_state_copies,
                              snapshot_copies=[(src, dst) for dst, src in self._snapshot_copies.items()])
        self._pending_copies, self._pending_state_copies, self._snapshot_copies = [], [], {}
        budget = self._schedule_running(out, self.max_num_batched_tokens, drafts or {})
        # After a preemption memory is tight: admitting now would only thrash.
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int,
                          drafts: Mapping[str, SequenceABC[int]]) -> int:
        bm = self.block_manager
        running = self.running
        i = 0
        while i < len(running) and budget > 0 and len(out.scheduled) < self.max_num_seqs:
            seq = running[i]
            if self._exceeds_cache(seq):
                self._cap(seq, out)
                continue
            start = seq.num_computed_tokens
            n = self._fit(seq, start, min(seq.num_tokens - start, budget))
            if n <= 0:  # nothing sampled for it yet, or its span waits for a fuller budget
                i += 1
                continue
            proposed = self._fitting_drafts(seq, n, budget, drafts)
            if proposed and bm.allocate(seq, n + len(proposed)):
                out.scheduled.append(ScheduledSequence(seq, n + len(proposed), draft_token_ids=proposed))
                budget -= n + len(proposed)
                i += 1
                continue
            while not bm.allocate(seq, n):
                victim = running.pop()  # most recently arrived
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSequence(seq, n))
                budget -= n
                i += 1
        return budget

    def _fitting_drafts(self, seq: Sequence, n: int, budget: int,
                        drafts: Mapping[str, SequenceABC[int]]) -> tuple[int, ...]:
        """The drafts of a decoding ``seq`` that fit the budget and the whole cache; () otherwise."""
        proposed = drafts.get(seq.seq_id)
        if not proposed or n != 1 or seq.num_computed_tokens != seq.num_tokens - 1:
            return ()
        bm = self.block_manager
        room = bm.num_blocks * bm.block_size - seq.num_tokens
        return tuple(proposed[: max(0, min(budget - 1, room))])

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        waiting = self.waiting
        while waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = waiting[0]
            if self._exceeds_cache(seq):
                self._cap(seq, out)
                continue
            cached, snapshot = self._cached_start(seq)
            start = len(cached) * bm.block_size
            n = self._fit(seq, start, min(seq.num_tokens - start, budget))
            if n <= 0 or not bm.allocate(seq, n, cached):
                break  # FCFS: nobody overtakes the head of the queue
            waiting.popleft()
            if self.state_slots is not None:
                self.state_slots.take(seq)
                if snapshot is not None:
                    out.snapshot_restores.append((snapshot, seq.state_slot))
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_arrival)
            out.scheduled.append(ScheduledSequence(seq, n))
            budget -= n

    def _cached_start(self, seq: Sequence) -> tuple[list[int], int | None]:
        """The cached blocks ``seq`` starts from and, for a model with recurrent state, the snapshot slot of
        the state after them: the KV prefix cut back to the deepest boundary with a snapshot."""
        cached = self.block_manager.match_prefix(seq)
        if self.state_cache is None or not cached:
            return cached, None
        hit = self.state_cache.lookup(seq.block_hashes[: len(cached)])
        if hit is None:
            return [], None
        blocks, slot = hit
        return cached[:blocks], slot

    def _fit(self, seq: Sequence, start: int, n: int) -> int:
        """``fit_chunk``, and with a state cache a prompt's chunk ends at its snapshot position."""
        n = fit_chunk(seq, start, n)
        if self.state_cache is not None:
            at = snapshot_position(seq.num_prompt_tokens, self.block_manager.block_size)
            if start < at < start + n:
                cut = fit_chunk(seq, start, at - start)
                n = cut if cut > 0 else n  # (an atomic span across it: no snapshot there)
        return n

    def _keep_state(self, chunk: ScheduledSequence) -> None:
        """A chunk that ended at its prompt's snapshot position: keep the state there (state_cache.py)."""
        if self.state_cache is None:
            return
        seq, bs = chunk.seq, self.block_manager.block_size
        at = snapshot_position(seq.num_prompt_tokens, bs)
        if at == 0 or seq.num_computed_tokens != at or chunk.start >= at:
            return
        assert seq.state_slot is not None
        copy = self.state_cache.store(self.block_manager.block_hash(seq, at // bs - 1), seq.state_slot)
        if copy is not None:
            src, dst = copy
            self._snapshot_copies[dst] = src  # (a snapshot evicted again before the copy: the later wins)

    def forget_cached(self) -> None:
        """Drop the prefix cache, KV blocks and state snapshots (their memory is about to go); nothing
        may hold a block."""
        self.block_manager.reset()
        if self.state_cache is not None:
            self.state_cache.clear()
        self._snapshot_copies = {}

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        # Recompute, not swap: drop the KV, keep the tokens (outputs included);
        # the prefix cache often makes the recompute cheap.
        self._free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        # Victims come newest first, so appendleft keeps the front in arrival order.
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _free(self, seq: Sequence) -> None:
        """Give back what ``seq`` holds: its blocks and its state slot."""
        self.block_manager.free(seq)
        if self.state_slots is not None:
            self.state_slots.release(seq)

    def _exceeds_cache(self, seq: Sequence) -> bool:
        bm = self.block_manager
        return bm.num_blocks_for(seq.num_tokens) > bm.num_blocks

    def _cap(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.finish(seq)
        out.too_long.append(seq)

    # ---------------------------------------------------------------- update

    def update(self, output: SchedulerOutput, sampled: Mapping[str, int | SequenceABC[int] | None]) -> None:
        """Record that ``output`` ran: advance each chunk, cache full blocks, append samples.

        ``sampled`` maps ``seq_id`` to the token sampled for every chunk with
        ``samples``; sequences finished or aborted since ``schedule`` are skipped.
        None instead of a token ends a prefill-only sequence (a pooling request)
        with this chunk: its blocks are cached, then freed (``finish``).

        A speculating chunk's entry is a list: its accepted drafts, then the
        model's next token (shortened by the caller where the sequence stops).
        Only the KV of accepted tokens counts as computed, so the blocks that
        held nothing but rejected drafts are released and the prefix cache
        registers only blocks full of accepted tokens.
        """
        live = [s for s in output.scheduled if s.seq.status is SequenceStatus.RUNNING]
        missing = [s.seq.seq_id for s in live if s.samples and s.seq.seq_id not in sampled]
        if missing:
            raise KeyError(f"no sampled token for {missing}")
        bm = self.block_manager
        for s in live:
            seq = s.seq
            token = sampled[seq.seq_id] if s.samples else None
            if s.draft_token_ids or isinstance(token, (list, tuple)):
                self._accept(s, token if isinstance(token, (list, tuple)) else [token])
                continue
            seq.num_computed_tokens = s.start + s.num_new_tokens
            bm.cache_computed_blocks(seq)
            self._keep_state(s)
            if token is not None:
                seq.append_token(token)
            elif s.samples:
                self.finish(seq)

    def _accept(self, chunk: ScheduledSequence, tokens: SequenceABC[int]) -> None:
        """A verified chunk: append `tokens` (accepted drafts, then the next token); the KV computed is
        the chunk's real tokens and the accepted drafts, i.e. all but the last new token."""
        if not tokens:
            raise ValueError(f"no verified token for {chunk.seq.seq_id!r}")
        seq = chunk.seq
        for token in tokens:
            seq.append_token(token)
        real = chunk.num_new_tokens - len(chunk.draft_token_ids)
        seq.num_computed_tokens = chunk.start + real + len(tokens) - 1
        self.block_manager.trim(seq)
        self.block_manager.cache_computed_blocks(seq)
