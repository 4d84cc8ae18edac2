"""The engine loop: a thread that runs scheduler step -> model runner -> sampler -> outputs.

An embedding request (`RequestState.pooling`) is prefill only: its last prompt chunk hands back the pooled
hidden states instead of sampling, and its sequence ends there (pooled_prompt.py).

All scheduler and model state is touched by this thread only; the asyncio side submits commands
(add, abort, end, sleep, wakeup) through a queue and awaits their results, so the server's event loop
never blocks on a forward pass. Commands run between steps. `sleep` and `wakeup` are the loop's own: it
aborts what is in flight and forgets the cached blocks, and hands the memory to its runner.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Iterable
from typing import Any

import torch

from core.backend import BackendStats, EndResult, FinishReason, TokenLogprob
from core.channel import batched_sends
from core.errors import BackendError, ModelNotFoundError
from core.memory import trim_heap
from core.scheduling import (
    BlockManager,
    ScheduledSequence,
    Scheduler,
    SchedulerOutput,
    Sequence,
    StateCache,
    StateSlots,
)
from core_pytorch_backend.lora.manager import AdapterManager
from core_pytorch_backend.model_runner import ModelRunner
from core_pytorch_backend.multimodal_inputs import SequenceImages, cache_keys
from core_pytorch_backend.pooled_prompt import PooledPrompt
from core_pytorch_backend.prompt_logprobs import score_tokens
from core_pytorch_backend.request_state import RequestState
from core_pytorch_backend.sampling import ArgmaxKernel, SampleKernel, SamplingBatch, SamplingRow, sample
from core_pytorch_backend.speculative import SpeculativeDecoder
from core_pytorch_backend.step_inputs import PromptRows, StepInputs, StepLogits, narrowed
from core_pytorch_backend.step_interrupt import StepInterrupt, StepInterrupted

log = logging.getLogger(__name__)
IDLE_WAIT_SECONDS = 0.5  # also how long the loop is idle, after steps, before it trims the heap
Scored = list[tuple[PromptRows, list[TokenLogprob]]]  # a step's prompt rows and their scored entries
Pooled = list[tuple[PromptRows, torch.Tensor]]  # a step's pooling rows and their hidden states
# a forward pass's outputs: the sampling chunks, each one's sampler rows, the sampler's result, prompt scores, pooled
Outputs = tuple[list[ScheduledSequence], list[list[int]], Any, Scored, Pooled]


class EngineLoop:
    """Owns the scheduler and the model runner; see the module docstring."""

    def __init__(self, runner: ModelRunner, *, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, enable_prefix_caching: bool, state_snapshots: int = 0,
                 sample_kernel: SampleKernel | None = None, argmax_kernel: ArgmaxKernel | None = None,
                 adapters: AdapterManager | None = None, speculative: SpeculativeDecoder | None = None,
                 interrupt: StepInterrupt | None = None) -> None:
        self.runner = runner
        self.interrupt = interrupt  # the runner's too: aborts stop the forward pass they empty (None: never)
        self.speculative = speculative  # proposals verified each step (speculative/); None: off
        self.adapters = adapters  # LoRA slots (lora/manager.py); None: adapters are off
        self._adapter_slots: dict[str, tuple[str, int]] = {}  # session id -> (adapter, slot) while in flight
        # in flight but not scheduled yet: their adapter has no slot (all held); arrival order
        self._waiting_for_slot: dict[str, RequestState] = {}
        self.sample_kernel = sample_kernel  # the op set's fused sampler, if it has one
        self.argmax_kernel = argmax_kernel  # and its argmax of the greedy rows
        self.max_model_len = max_model_len
        # a model with recurrent state starts a sequence from cached blocks only with a snapshot of its state
        # there: `state_snapshots` of them at most (core/scheduling/state_cache.py), none: no prefix cache
        recurrent = runner.has_recurrent_state
        caching = enable_prefix_caching and (not recurrent or state_snapshots > 0)
        self.block_manager = BlockManager(runner.num_blocks, runner.block_size, caching,
                                          lazy_memory=runner.kv_memory_is_lazy)
        slots = StateSlots() if recurrent else None
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max(max_num_batched_tokens, 1), state_slots=slots,
                                   state_cache=StateCache(state_snapshots) if slots and caching else None)
        self.requests: dict[str, RequestState] = {}  # in flight
        self.known: set[str] = set()  # generated for and not yet ended
        self._by_seq: dict[str, tuple[RequestState, int]] = {}
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]] = queue.SimpleQueue()
        self._stopping = False
        self._stepped_since_trim = False  # steps ran since the heap was last trimmed (_trim_when_idle)
        self._thread = threading.Thread(target=self._run, name="core-pytorch-engine", daemon=True)
        self._thread.start()

    # -- called from other threads --------------------------------------------------------------------

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn` on the loop thread between steps; the future holds its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._stopping:
            future.set_exception(BackendError("the backend is closed"))
        elif not self._thread.is_alive():  # nobody would ever run it
            future.set_exception(BackendError("the engine loop thread has died; see the log"))
        else:
            self._commands.put((fn, future))
        return future

    def call_aborting(self, fn: Callable[[], Any], session_ids: Collection[str] | None) -> concurrent.futures.Future:
        """`call(fn)` for a command that aborts `session_ids` (None: every request): a forward pass whose
        requests all have an abort queued stops at its next attention layer, so the aborts run without
        waiting for the step to end (step_interrupt.py)."""
        interrupt = self.interrupt
        if interrupt is None:
            return self.call(fn)
        interrupt.aborting(session_ids)

        def command() -> Any:
            try:
                return fn()
            finally:
                interrupt.aborted(session_ids)

        return self.call(command)

    def stop(self) -> None:
        if self._thread.is_alive():
            self.call_aborting(self._shutdown, None).result(timeout=60)
            self._thread.join(timeout=60)

    @property
    def asleep(self) -> frozenset[str]:
        """The parts sleep released and wakeup has not restored yet ("kv_cache", "weights")."""
        return frozenset(self.runner.asleep)

    def stats(self, is_sleeping: bool) -> BackendStats:
        if not self._stopping and not self._thread.is_alive():  # the server's /health answers 503
            raise BackendError("the engine loop thread has died; see the log")
        bm = self.block_manager
        return BackendStats(
            running=self.scheduler.num_running, waiting=self.scheduler.num_waiting + len(self._waiting_for_slot),
            sessions=len(self.known),
            kv_blocks_total=self.runner.num_blocks, kv_blocks_used=bm.num_used_blocks,
            block_size=self.runner.block_size, prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits, is_sleeping=is_sleeping,
            spec_decode=self.speculative.snapshot() if self.speculative is not None else None,
        )

    # -- the thread -----------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            if not self._stopping:  # dying (a BaseException): nobody will answer the requests in flight
                self._fail_on_death()

    def _fail_on_death(self) -> None:
        log.critical("the engine loop thread is dying; failing %d request(s) in flight", len(self.requests))
        error = BackendError("the engine loop thread has died; see the log")
        for state in list(self.requests.values()):
            state.send(error)
            state.end_stream()

    def _serve(self) -> None:
        while not self._stopping:
            if self._waiting_for_slot:
                self._admit_waiting_for_slot()
            self._drain_commands(block=not self.scheduler.has_unfinished)
            if self._stopping or not self.scheduler.has_unfinished:
                continue
            self._stepped_since_trim = True
            with batched_sends():  # the step's outputs reach the event loop in one wake-up
                try:
                    self._step()
                except Exception as exc:  # outside the isolated part of a step: fail all; the loop keeps serving
                    log.exception("engine step failed")
                    self._fail_all(exc)

    def _drain_commands(self, block: bool) -> None:
        while True:
            try:
                fn, future = self._commands.get(timeout=IDLE_WAIT_SECONDS) if block else self._commands.get_nowait()
            except queue.Empty:
                if block:
                    self._trim_when_idle()
                return
            block = False
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:
                    future.set_exception(exc)

    def _trim_when_idle(self) -> None:
        """Once the loop has been idle IDLE_WAIT_SECONDS after steps, hand the C heap's freed memory back to the OS.
        A step's activations of a few MB each come from glibc's arenas once its mmap threshold has risen
        past them (it follows the largest block freed, up to 32 MB), and the arenas keep their peak: on a
        2-core Zen 4 EPYC the default model's server held 1,334 MB resident after loads of 1 to 64 streams,
        1,196 MB after a trim. Idle only, so no request waits for it under load."""
        if self._stepped_since_trim:
            self._stepped_since_trim = False
            start = time.perf_counter()
            trim_heap()
            log.debug("idle: heap trimmed in %.1f ms", 1e3 * (time.perf_counter() - start))

    def _shutdown(self) -> None:
        for state in list(self.requests.values()):
            self._finish_request(state, FinishReason.ABORT)
        self._stopping = True

    # -- commands -------------------------------------------------------------------------------------

    def add(self, state: RequestState) -> None:
        """Schedule `state`, or, when its LoRA adapter has no slot (all held by running requests), keep it
        in flight unscheduled until one frees (`_admit_waiting_for_slot`): it holds no slot nor KV block,
        and it can be aborted like any request. Requests of the base pass it; a later request for any
        adapter queues behind it, so that a busy resident adapter cannot keep the slot forever (the wait
        is bounded by the requests running when it arrived)."""
        sid = state.session_id
        if sid in self.requests:
            raise BackendError(f"session {sid!r} is already generating")
        name = state.request.config.adapter
        if name is not None and (self._waiting_for_slot or not self._adapter_manager(name).has_slot_for(name)):
            self.scheduler.check(self._new_sequence(state, self._adapter_manager(name).key(name)))  # a 400 now
            self._waiting_for_slot[sid] = state
            log.debug("request %s waits for a LoRA slot for %r", sid, name)
        else:
            self._start(state)
        state.open_choices = set(range(state.n))
        self.requests[sid] = state
        if state.pooling is None:  # an embedding request has no session to end
            self.known.add(sid)

    def _start(self, state: RequestState) -> None:
        """Take the request's adapter slot (if any) and queue choice 0's sequence in the scheduler."""
        adapter_key = self._take_adapter(state)
        try:
            seq = self._new_sequence(state, adapter_key)
            self.scheduler.add(seq)  # ValueError if it can never fit
        except BaseException:
            self._give_back_adapter(state.session_id)
            raise
        state.sequences[0] = seq
        self._by_seq[seq.seq_id] = (state, 0)

    def _admit_waiting_for_slot(self) -> None:
        """Start the waiting requests in arrival order, up to the first whose adapter still finds no slot
        (first come, first served: see `add`)."""
        assert self.adapters is not None
        for sid, state in list(self._waiting_for_slot.items()):
            name = state.request.config.adapter
            assert name is not None
            try:
                if not self.adapters.has_slot_for(name):
                    break
                del self._waiting_for_slot[sid]
                self._start(state)
            except Exception as exc:  # e.g. the adapter was unloaded while it waited: a 404
                self._waiting_for_slot.pop(sid, None)
                state.send(exc)
                self._finish_request(state, FinishReason.ERROR)

    def _adapter_manager(self, name: str) -> AdapterManager:
        if self.adapters is None:
            raise ModelNotFoundError(f"no LoRA adapter {name!r} is loaded", param="model")
        return self.adapters

    def _take_adapter(self, state: RequestState) -> str | None:
        """The slot of the request's LoRA adapter, held until the request ends; its prefix-cache key."""
        name = state.request.config.adapter
        if name is None:
            return None
        slot, key = self._adapter_manager(name).acquire(name)
        self._adapter_slots[state.session_id] = (name, slot)
        return key

    def _give_back_adapter(self, session_id: str) -> None:
        held = self._adapter_slots.pop(session_id, None)
        if held is not None and self.adapters is not None:
            self.adapters.release(held[0])

    def _chunk_adapter_slots(self, chunks: list[ScheduledSequence]) -> list[int] | None:
        if not self._adapter_slots:
            return None
        owners = (self._owner(chunk) for chunk in chunks)
        return [self._adapter_slots.get(o.session_id, ("", -1))[1] if o is not None else -1 for o in owners]

    def _new_sequence(self, state: RequestState, adapter_key: str | None = None) -> Sequence:
        """Choice 0's sequence; a request with images carries them, and their content hashes key the
        prefix cache (same image and prefix: a hit; another image with the same text: a miss). Images
        whose tokens attend to each other both ways (Gemma 3) are atomic: never split across chunks.
        A LoRA adapter's key is folded into every prompt block's hash: two adapters never share KV."""
        prompt = state.request.prompt_token_ids
        adapter_keys = [] if adapter_key is None else [(0, len(prompt), adapter_key)]
        inputs = state.request.multimodal
        # a cached prefix has no logits to score it with, nor hidden states to pool but the last
        skip_cache = state.prompt_scores is not None or (state.pooling is not None and
                                                         not state.pooling.reads_prefix_cache)
        if inputs is None:
            return Sequence(f"{state.session_id}#0", prompt, adapter_keys, skip_reading_prefix_cache=skip_cache)
        if list(inputs.prompt_token_ids) != list(state.request.prompt_token_ids):
            raise ValueError("the multimodal inputs do not belong to this prompt")
        model = self.runner.model
        images = SequenceImages.from_inputs(inputs, model.config.hidden_size, self.runner.device,
                                            self.runner.dtype, getattr(model, "uses_mrope", False))
        return Sequence(f"{state.session_id}#0", prompt, [*cache_keys(inputs), *adapter_keys],
                        multimodal=images, atomic_spans=images.spans if images.bidirectional else (),
                        skip_reading_prefix_cache=skip_cache)

    def abort(self, session_id: str) -> None:
        state = self.requests.get(session_id)
        if state is not None:
            self._finish_request(state, FinishReason.ABORT)

    def end(self, session_id: str) -> EndResult:
        self.abort(session_id)
        if session_id in self.known:
            self.known.discard(session_id)
            return EndResult.ENDED
        return EndResult.NOT_FOUND

    def abort_many(self, session_ids: list[str]) -> None:
        for session_id in session_ids:
            self.abort(session_id)

    def abort_all(self) -> None:
        for state in list(self.requests.values()):
            self._finish_request(state, FinishReason.ABORT)

    def sleep(self, level: int) -> None:
        """Abort everything in flight, forget the cached blocks, and let the runner free its memory."""
        self.abort_all()
        self.scheduler.forget_cached()  # nothing holds a block now; the memory the cache indexes is about to go
        self.runner.sleep(level)

    def wakeup(self, tags: Iterable[str], load_model: Callable[[], torch.nn.Module]) -> None:
        """Restore the parts named by `tags` (dropped weights from `load_model()`)."""
        self.runner.wakeup(tags, load_model)

    # -- one step -------------------------------------------------------------------------------------

    def _step(self) -> None:
        out = self.scheduler.schedule(self._drafts())
        for seq in out.too_long:
            self._close_sequence(seq, FinishReason.LENGTH)
        self.runner.copy_blocks(out.block_copies)
        if out.snapshot_copies:  # first: they may overwrite a snapshot that a restore then reads
            self.runner.keep_states(out.snapshot_copies)
        if out.snapshot_restores:
            self.runner.restore_states(out.snapshot_restores)
        if out.state_copies:  # (only a model with recurrent state has any: a tensor-parallel runner has none)
            self.runner.copy_states(out.state_copies)
        if not out.scheduled:
            return
        if not self.runner.has_kv_cache:
            self._fail_all(BackendError("the KV cache is released (the backend is asleep); wake it up"))
            return
        self._run_chunks(out.scheduled)

    def _run_chunks(self, chunks: list[ScheduledSequence]) -> None:
        """Forward `chunks`, then sample them and record the results. A failure is isolated to the requests
        that cause it: a failed forward by running the step again in halves (`_isolate_failure`); a failed
        sampler, prompt scoring or pooling request by request on the same forward (`_record_each`)."""
        try:
            inputs, step = self._forward(chunks)
        except StepInterrupted:
            return  # its requests are all being aborted: the command that aborts them runs next
        except Exception as exc:
            self._isolate_failure(chunks, exc)
            return
        try:
            outputs = self._outputs(inputs, step)
        except Exception as exc:
            self._record_each(chunks, inputs, step, exc)
            return
        self._record(chunks, outputs)

    def _record(self, chunks: list[ScheduledSequence], outputs: Outputs) -> None:
        """Advance the scheduler by `chunks` and hand each request what its chunks produced."""
        sampling, groups, result, scored, pooled = outputs
        tokens: dict[str, Any] = {c.seq.seq_id: self._sampled(c, [result.token_ids[r] for r in g])
                                  for c, g in zip(sampling, groups, strict=True)}
        pooled_ends = [c.seq for c in chunks if c.samples and self._pooling(c) is not None]
        tokens.update(dict.fromkeys((seq.seq_id for seq in pooled_ends), None))  # they end, unsampled
        self.scheduler.update(SchedulerOutput(scheduled=chunks), tokens)
        for rows, entries in scored:
            self._record_prompt_scores(rows, entries)
        for rows, hidden in pooled:
            self._record_pooled(rows, hidden)
        for seq in pooled_ends:
            self._deliver_embedding(seq)
        if sampling:
            self._emit(sampling, groups, result, tokens)

    def _forward(self, chunks: list[ScheduledSequence]) -> tuple[StepInputs, StepLogits]:
        """The forward pass: it writes the chunks' KV (the same values when run again) and advances a
        recurrent model's states (which running it again would advance twice)."""
        inputs = self.runner.prepare(chunks, self._scoring_prompts(chunks), self._pooling_positions(chunks),
                                     self._chunk_adapter_slots(chunks))
        with self._interruptible(chunks):
            return inputs, self.runner.forward(inputs)

    def _interruptible(self, chunks: list[ScheduledSequence]) -> contextlib.AbstractContextManager[None]:
        """The forward pass of `chunks`, marked with the requests an abort must cover to stop it: all but the
        embeddings, whose chunks can run again (not a recurrent model's, whose states advance)."""
        if self.interrupt is None:
            return contextlib.nullcontext()
        recurrent = self.runner.has_recurrent_state
        owners = {state.session_id for state in map(self._owner, chunks)
                  if state is not None and (state.pooling is None or recurrent)}
        return self.interrupt.step(owners)

    def _outputs(self, inputs: StepInputs, step: StepLogits) -> Outputs:
        """The prompt scores, the hidden states to pool and the sampler's tokens of a forward pass: no
        scheduler, request or model state changes, so it can be computed again on any part of the step."""
        scored = self._score_prompts(inputs.prompt_rows, step.prompt_hidden)
        pooled = _split_rows(inputs.pooling_rows, step.pooling_hidden)
        logits = step.sample
        sampling = inputs.sampling
        if not sampling:
            return [], [], None, scored, pooled
        rows, groups, owners = self._sampling_rows(sampling)
        if owners != list(range(len(owners))):  # a first sample of an n > 1 request reads its logits n times
            logits = logits.index_select(0, torch.tensor(owners, device=logits.device))
        return sampling, groups, sample(logits, SamplingBatch.from_rows(rows, device=logits.device),
                                        self.sample_kernel, self.argmax_kernel), scored, pooled

    def _record_each(self, chunks: list[ScheduledSequence], inputs: StepInputs, step: StepLogits,
                     exc: Exception) -> None:
        """The outputs of a forward pass failed: compute them request by request from the same forward. A
        request that fails alone ends with the error; the others are recorded as if nothing happened (the
        forward ran once, so a recurrent model's states are right for every one of them)."""
        log.warning("a step's outputs failed (%r): computing them request by request", exc)
        by_request: dict[int, tuple[RequestState, list[ScheduledSequence]]] = {}
        for chunk in chunks:
            if (state := self._owner(chunk)) is not None:
                by_request.setdefault(id(state), (state, []))[1].append(chunk)
        for state, group in by_request.values():  # (recording or failing one ends no other request)
            try:
                outputs = self._outputs(*narrowed(inputs, step, {c.seq.seq_id for c in group}))
            except Exception as alone:
                log.error("request %s failed its engine step: %r", state.session_id, alone)
                self._fail_request(state, alone)
                continue
            self._record(group, outputs)

    # -- speculative decoding (speculative/) -----------------------------------------------------------

    def _drafts(self) -> dict[str, list[int]]:
        """This step's proposals for the running rows that may speculate ({} when speculation is off)."""
        if self.speculative is None:
            return {}
        rows = ((state, seq) for seq in self.scheduler.running
                if (state := self._by_seq.get(seq.seq_id, (None, None))[0]) is not None)
        return self.speculative.drafts(rows, self.max_model_len)

    def _sampled(self, chunk: ScheduledSequence, tokens: list[int]) -> int | list[int]:
        """What the scheduler records for a sampling chunk: its token, or a verified row's kept tokens."""
        state = self._owner(chunk)
        if not chunk.draft_token_ids or state is None:  # (an ended request's chunk is not recorded)
            return tokens[0]
        assert self.speculative is not None
        return self.speculative.verify(state, chunk, tokens)

    # -- embeddings (pooled_prompt.py) ----------------------------------------------------------------

    def _pooling(self, chunk: ScheduledSequence) -> PooledPrompt | None:
        state = self._owner(chunk)
        return state.pooling if state is not None else None

    def _pooling_positions(self, chunks: list[ScheduledSequence]) -> dict[str, range]:
        """The positions whose hidden states each pooling sequence of this step keeps."""
        return {c.seq.seq_id: pooling.positions for c in chunks if (pooling := self._pooling(c)) is not None}

    def _record_pooled(self, rows: PromptRows, hidden: torch.Tensor) -> None:
        state = self._by_seq.get(rows.seq_id, (None, None))[0]
        if state is not None and state.pooling is not None:
            state.pooling.add(rows.first_position, hidden)

    def _deliver_embedding(self, seq: Sequence) -> None:
        """The prompt is computed (the scheduler has freed its blocks): send the vector, end the request."""
        state = self._by_seq[seq.seq_id][0]
        assert state.pooling is not None
        try:
            state.send(state.pooling.vector())
        except Exception as exc:
            log.error("request %s failed to pool its hidden states: %r", state.session_id, exc)
            self._fail_request(state, exc)
            return
        self._close_sequence(seq, FinishReason.STOP, notify=False)

    # -- prompt logprobs (prompt_logprobs.py) ---------------------------------------------------------

    def _scoring_prompts(self, chunks: list[ScheduledSequence]) -> frozenset[str]:
        """Sequences of this step whose prompt positions are still to be scored."""
        wanted = set()
        for chunk in chunks:
            state = self._owner(chunk)
            if state is not None and state.prompt_scores is not None and not state.prompt_scores.complete:
                wanted.add(chunk.seq.seq_id)
        return frozenset(wanted)

    def _score_prompts(self, rows: tuple[PromptRows, ...], hidden: torch.Tensor | None) -> Scored:
        """(rows, scored entries) for each sequence's prompt rows of this step."""
        scored, offset = [], 0
        for r in rows:
            scores = self._by_seq[r.seq_id][0].prompt_scores
            assert scores is not None and hidden is not None
            targets = scores.targets(r.first_position, r.count)
            scored.append((r, score_tokens(hidden[offset : offset + r.count], targets, scores.k, self.runner.logits)))
            offset += r.count
        return scored

    def _record_prompt_scores(self, rows: PromptRows, entries: list[TokenLogprob]) -> None:
        state = self._by_seq.get(rows.seq_id, (None, None))[0]
        if state is not None and state.prompt_scores is not None:
            state.prompt_scores.add(rows.first_position, entries)

    def _isolate_failure(self, chunks: list[ScheduledSequence], exc: Exception) -> None:
        """A forward pass failed: bisect. Each half runs again on its own; a request that fails alone ends
        with the error, so one bad request costs the others a few recomputed steps, never their results. A
        model with recurrent state cannot run a forward again (its layers advanced each sequence's state as
        far as they got): every request of the step ends with the error. (What a request brings to a forward
        is checked before it is admitted; a request's own failures are its outputs', `_record_each`.)"""
        states = {id(state): state for state in (self._owner(c) for c in chunks) if state is not None}
        if len(states) <= 1 or self.runner.has_recurrent_state:
            for state in states.values():
                log.error("request %s failed its engine step: %r", state.session_id, exc)
                self._fail_request(state, exc)
            return
        middle = len(chunks) // 2
        for half in (chunks[:middle], chunks[middle:]):
            live = [c for c in half if self._owner(c) is not None]  # a failed request's forks are gone
            if live:
                self._run_chunks(live)

    def _owner(self, chunk: ScheduledSequence) -> RequestState | None:
        """The request in flight that `chunk` belongs to; None once it ended."""
        state, _ = self._by_seq.get(chunk.seq.seq_id, (None, None))
        return state

    def _sampling_rows(self, sampling: list[ScheduledSequence]
                       ) -> tuple[list[SamplingRow], list[list[int]], list[int]]:
        """Sampler rows, which rows belong to each chunk (n rows for an n > 1 request's first sample, one
        per verified position of a speculating chunk, one otherwise), and the logits row each reads."""
        rows: list[SamplingRow] = []
        groups: list[list[int]] = []
        owners: list[int] = []
        logits_row = 0
        for chunk in sampling:
            seq = chunk.seq
            state, index = self._by_seq[seq.seq_id]
            if chunk.draft_token_ids:
                assert self.speculative is not None
                new = self.speculative.rows(state, index, chunk, self.runner.device)
                owners.extend(range(logits_row, logits_row + len(new)))
                logits_row += len(new)
            else:
                choices = range(state.n) if state.n > 1 and not state.forked else (index,)
                new = [SamplingRow(state.params, seq.prompt_token_ids, seq.output_token_ids,
                                   state.generator(choice, self.runner.device), state.banned(seq),
                                   state.matcher(choice)) for choice in choices]
                owners.extend([logits_row] * len(new))
                logits_row += 1
            groups.append(list(range(len(rows), len(rows) + len(new))))
            rows.extend(new)
        return rows, groups, owners

    def _emit(self, sampling: list[ScheduledSequence], groups: list[list[int]], result: Any,
              tokens: dict[str, Any]) -> None:
        for chunk, rows in zip(sampling, groups, strict=True):
            seq = chunk.seq
            state, index = self._by_seq.get(seq.seq_id, (None, None))
            if state is None or state.session_id not in self.requests:
                continue
            if chunk.draft_token_ids:
                self._deliver_verified(state, index, tokens[seq.seq_id], [result.logprobs[r] for r in rows])
                continue
            if len(rows) > 1:
                self._fork(state, seq, [result.token_ids[r] for r in rows[1:]])
            for choice, r in zip((index, *range(1, len(rows))), rows, strict=True):
                self._deliver(state, choice, result.token_ids[r], result.logprobs[r])

    def _fork(self, state: RequestState, parent: Sequence, tokens: list[int]) -> None:
        """n > 1: children share the prompt's blocks; each starts from its own first token."""
        state.forked = True
        for choice, token in enumerate(tokens, start=1):
            child = parent.fork(f"{state.session_id}#{choice}")
            child.token_ids[-1] = token
            self.scheduler.fork(parent, child)
            state.sequences[choice] = child
            self._by_seq[child.seq_id] = (state, choice)

    def _deliver_verified(self, state: RequestState, choice: int, tokens: list[int],
                          logprobs: list[Any]) -> None:
        """A speculating row's kept tokens, one output each (`SpeculativeDecoder.verify` cut them at the
        first that ends the choice, so only the last can finish it)."""
        seq = state.sequences[choice]
        for j, token in enumerate(tokens):
            finish = state.finish_reason(seq, token) if j == len(tokens) - 1 else None
            state.send(state.output(choice, token, finish, logprobs[j]))
            if finish is not None:
                self._close_sequence(seq, finish, notify=False)

    def _deliver(self, state: RequestState, choice: int, token: int, logprobs: Any) -> None:
        seq = state.sequences[choice]
        constrained = state.constrain(choice, token)  # a token the constraint refused ends it: "length"
        finish = constrained if constrained is FinishReason.LENGTH else state.finish_reason(seq, token) or constrained
        state.send(state.output(choice, token, finish, logprobs))
        if finish is not None:
            self._close_sequence(seq, finish, notify=False)

    # -- finishing ------------------------------------------------------------------------------------

    def _close_sequence(self, seq: Sequence, reason: FinishReason, notify: bool = True) -> None:
        state, choice = self._by_seq.pop(seq.seq_id, (None, None))
        if self.speculative is not None:
            self.speculative.release(seq.seq_id)
        if not seq.is_finished:
            self.scheduler.finish(seq)
        if state is None:
            return
        if notify:
            state.close_choice(choice, reason)
        else:
            state.open_choices.discard(choice)
        if not state.open_choices and (state.forked or state.n == 1):
            self._drop_request(state)

    def _finish_request(self, state: RequestState, reason: FinishReason) -> None:
        for seq in list(state.sequences.values()):
            if seq.seq_id in self._by_seq:
                self._close_sequence(seq, reason)
        for choice in sorted(state.open_choices):  # choices never forked yet
            state.close_choice(choice, reason)
        self._drop_request(state)

    def _drop_request(self, state: RequestState) -> None:
        if self.requests.get(state.session_id) is state:
            del self.requests[state.session_id]
            self._waiting_for_slot.pop(state.session_id, None)
            self._give_back_adapter(state.session_id)  # a waiting request may start at the loop's next turn
            for seq in state.sequences.values():
                self._by_seq.pop(seq.seq_id, None)
                if self.speculative is not None:
                    self.speculative.release(seq.seq_id)
                if self.scheduler.get(seq.seq_id) is not None:
                    self.scheduler.abort(seq.seq_id)
            state.end_stream()

    def _fail_all(self, exc: Exception) -> None:
        """A step failed outside its isolated part: its requests fail; those waiting for a slot wait on."""
        for state in list(self.requests.values()):
            if state.session_id not in self._waiting_for_slot:
                self._fail_request(state, exc)

    def _fail_request(self, state: RequestState, exc: Exception) -> None:
        error = exc if isinstance(exc, BackendError) else BackendError(f"engine step failed ({type(exc).__name__})")
        state.send(error)
        self._finish_request(state, FinishReason.ERROR)


def _split_rows(rows: tuple[PromptRows, ...], hidden: torch.Tensor | None) -> Pooled:
    """Each of `rows` with its slice of `hidden` (their rows, concatenated in order)."""
    pieces, offset = [], 0
    for r in rows:
        assert hidden is not None
        pieces.append((r, hidden[offset : offset + r.count]))
        offset += r.count
    return pieces
