"""ModelRunner: turns a scheduled batch into tensors, runs the model, and owns the KV cache.

It knows nothing about requests or sampling: the engine loop hands it the scheduler's output and gets
back float32 logits for the sequences that sample this step, and the hidden states of the prompt
positions whose next token some request scores (prompt logprobs). It also owns what sleep releases:
`sleep(level)` frees the KV cache (and the decode path that baked it in) and moves or drops the weights,
`wakeup(tags)` restores them.

Decode steps may take a faster path than the model's modules (``DecodePath``): captured CUDA graphs on
a GPU (cuda_graphs.py), the native decoder stack on the CPU (native_decode.py).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from typing import Protocol

import torch

from core.scheduling import ScheduledSequence
from core_pytorch_backend.attention_metadata import AttentionMetadata
from core_pytorch_backend.layers.attention import (
    allocate_kv_caches,
    bind_kv_caches,
    kv_cache_owners,
    kv_cache_shape,
    unbind_kv_caches,
)
from core_pytorch_backend.layers.recurrent import (
    allocate_recurrent_states,
    copy_slots_between,
    copy_state_slots,
    recurrent_layers,
    unbind_recurrent_states,
)
from core_pytorch_backend.lora.layers import LoraStep
from core_pytorch_backend.multimodal_inputs import with_images
from core_pytorch_backend.native import tile_rows
from core_pytorch_backend.step_inputs import PromptRows, StepInputs, StepLogits, prompt_rows_of, rows_in
from core_pytorch_backend.step_interrupt import StepInterrupt

log = logging.getLogger(__name__)
DEFAULT_CPU_KV_CACHE_GIB = 1.0
ZERO_BLOCKS_AT_LEAST = 64  # the CPU cache is zeroed this many blocks (or more) at a time
# A model whose layers are all recurrent (Mamba) stores no KV: its blocks only count tokens (no memory behind them)
BLOCKS_WITHOUT_KV = 65536


class DecodePath(Protocol):
    """A faster way through a decode step than the model's modules, baked in the weights and KV cache."""

    def run(self, model: torch.nn.Module, inputs: StepInputs) -> torch.Tensor | None:
        """The step's hidden states, or None: the step runs through the modules."""

    def release(self) -> None:
        """Drop what it holds of the weights and KV cache (they are about to be freed)."""

    def try_capture(self, model: torch.nn.Module) -> bool:
        """Bake ``model``'s current weights and cache in again (after a wakeup); False if it cannot."""


def kv_bytes_per_block(model: torch.nn.Module, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across the layers that own a KV cache (keys and values)."""
    shapes = (kv_cache_shape(layer, 1, block_size, dtype) for layer in kv_cache_owners(model))
    return sum(2 * math.prod(shape) * dtype.itemsize for shape in shapes)


def kv_cache_budget(device: torch.device, memory_gib: float | None, memory_fraction: float) -> float:
    """Bytes the KV cache may take: an absolute GiB size, else a fraction of free GPU memory, else the CPU's
    default."""
    if memory_gib is not None:
        return memory_gib * 2**30
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free * memory_fraction
    return DEFAULT_CPU_KV_CACHE_GIB * 2**30


def state_snapshot_budget(device: torch.device, memory_gib: float | None, memory_fraction: float) -> float:
    """Bytes a recurrent model's prefix-cache state snapshots may take (core/scheduling/state_cache.py): a
    quarter of the KV cache's budget; on a GPU without a GiB size, half the memory the KV cache leaves free."""
    if memory_gib is None and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free * (1 - memory_fraction) / 2
    return kv_cache_budget(device, memory_gib, memory_fraction) / 4


def kv_cache_blocks(model: torch.nn.Module, block_size: int, dtype: torch.dtype, device: torch.device,
                    memory_gib: float | None, memory_fraction: float) -> int:
    """How many blocks fit the budget: an absolute GiB size, else a fraction of free GPU memory."""
    per_block = kv_bytes_per_block(model, block_size, dtype)
    if per_block == 0:
        return BLOCKS_WITHOUT_KV
    budget = kv_cache_budget(device, memory_gib, memory_fraction)
    blocks = int(budget // per_block)
    if blocks < 1:
        raise ValueError(f"the KV-cache budget ({budget / 2**20:.1f} MiB) holds no block of {per_block} bytes")
    return blocks


class ModelRunner:
    """Runs one model over paged KV caches of `num_blocks` blocks of `block_size` tokens.

    :param kv_cache_dtype: the KV cache's dtype (None: ``dtype``, the model's).
    :param decode_path: builds the model's ``DecodePath`` (its KV cache bound), or None where none applies
        (cuda_graphs.make_decode_graphs, native_decode.make_native_decode); None: always the modules.
    :param tile_rule: where the model has packed weights whose kernels have AMX tiles, which rows of each
        forward pass are marked for their tile loop (native/tile_rows.py: ``prompt``, a step's prompt-token
        rows; ``all``, every row); the native decode stack takes a step whose rows are all marked or none.
    :param interrupt: lets an abort stop a forward pass between two attention layers (step_interrupt.py);
        None: every forward pass runs to its end.
    """

    def __init__(self, model: torch.nn.Module, *, block_size: int, num_blocks: int, device: torch.device,
                 dtype: torch.dtype, kv_cache_dtype: torch.dtype | None = None,
                 decode_path: Callable[[torch.nn.Module], DecodePath | None] | None = None,
                 lora_step: LoraStep | None = None, tile_rule: str = "prompt",
                 interrupt: StepInterrupt | None = None) -> None:
        self.model = model
        self.interrupt = interrupt
        if tile_rule not in tile_rows.RULES:
            raise ValueError(f"tile_rule must be one of {', '.join(tile_rows.RULES)}, got {tile_rule!r}")
        self.marks_tile_rows = tile_rows.has_tiled_weights(model)
        self.tile_rule = tile_rule
        self.lora_step = lora_step  # the row-to-adapter map of the model's LoRA layers (lora/layers.py)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype or dtype
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        # recurrent layers' per-sequence states (layers/recurrent.py), grown to the slots in use; they are part
        # of what sleep's "kv_cache" releases
        self.has_recurrent_state = bool(recurrent_layers(model))
        self.recurrent_states: list[tuple[torch.Tensor, ...]] = []
        # the prefix cache's snapshots of them (core/scheduling/state_cache.py), slots of their own: the running
        # sequences' slots stay dense, so a decode step's states are a view, not a gather
        self.snapshot_states: list[tuple[torch.Tensor, ...]] = []
        self.zeroed_blocks = 0  # blocks [0, zeroed_blocks) of the cache are zeroed (see _zero_blocks_up_to)
        self.asleep: set[str] = set()  # the parts sleep released: "kv_cache", "weights"
        self._weights_dropped = False  # level 2: the weights must be loaded again on wakeup
        self.allocate_kv_cache()
        self.decode_path: DecodePath | None = decode_path(model) if decode_path is not None else None

    @property
    def has_kv_cache(self) -> bool:
        return self.kv_caches is not None

    @property
    def kv_memory_is_lazy(self) -> bool:
        """The cache's memory is reached as blocks are first used (see allocate_kv_cache)."""
        return self.device.type == "cpu"

    def allocate_kv_cache(self) -> None:
        """The CPU cache starts unzeroed and is zeroed block by block as steps reach it, so that the
        process's resident memory follows the blocks in use rather than the whole budget. A GPU cache
        is zeroed at once: its memory is reserved either way."""
        lazy = self.kv_memory_is_lazy
        self.kv_caches = allocate_kv_caches(self.model, self.num_blocks, self.block_size, self.kv_cache_dtype,
                                            self.device, zeroed=not lazy)
        self.zeroed_blocks = 0 if lazy else self.num_blocks
        self.recurrent_states = []  # slots are allocated as sequences take them (_hold_state_slots)
        self.snapshot_states = []

    def _hold_state_slots(self, slots: Iterable[int | None]) -> None:
        """Grow the recurrent states (doubling, keeping what they hold) to cover every slot in ``slots``."""
        self.recurrent_states = self._grown(self.recurrent_states, slots, bind=True)

    def _grown(self, states: list[tuple[torch.Tensor, ...]], slots: Iterable[int | None],
               bind: bool) -> list[tuple[torch.Tensor, ...]]:
        needed = max((slot for slot in slots if slot is not None), default=-1) + 1
        held = len(states[0][0]) if states else 0
        if needed <= held:
            return states
        return allocate_recurrent_states(self.model, max(needed, 2 * held, 4), self.dtype, self.device,
                                         keep=states or None, bind=bind)

    def _zero_blocks_up_to(self, block_ids: Iterable[int]) -> None:
        """Zero every block below the highest of ``block_ids`` that is not zeroed yet, before a step
        touches them. Attention reads a block's unwritten slots (masked), and memory never written
        may hold NaN bit patterns, which a zero attention weight does not cancel (0 * NaN = NaN)."""
        if self.zeroed_blocks >= self.num_blocks or self.kv_caches is None:
            return
        end = max(block_ids, default=-1) + 1
        if end <= self.zeroed_blocks:
            return
        end = min(self.num_blocks, max(end, self.zeroed_blocks + ZERO_BLOCKS_AT_LEAST))
        for k_cache, v_cache in self.kv_caches:
            k_cache[self.zeroed_blocks : end].zero_()
            v_cache[self.zeroed_blocks : end].zero_()
        self.zeroed_blocks = end

    def zero_blocks(self, block_ids: Iterable[int]) -> None:
        """What `prepare` does to the cache before a step, for a runner that is handed another's prepared
        step (a tensor-parallel rank > 0, distributed/worker.py)."""
        self._zero_blocks_up_to(block_ids)

    def free_kv_cache(self) -> None:
        unbind_kv_caches(self.model)
        unbind_recurrent_states(self.model)
        self.kv_caches = None
        self.recurrent_states = []
        self.snapshot_states = []
        if self.decode_path is not None:
            self.decode_path.release()  # it baked in the freed cache
        _empty_device_cache(self.device)

    def sleep(self, level: int) -> None:
        """Release the KV cache; then, level 1, move the weights to host memory (they stay on the CPU),
        level 2, drop them. Each part is marked asleep as soon as it is released, so `asleep` is the real
        state even if a later part fails."""
        if self.has_kv_cache:
            self.free_kv_cache()
        self.asleep.add("kv_cache")
        if "weights" in self.asleep:
            return
        if level == 2:
            self.model.to("meta")  # weights dropped; loaded again on wakeup
        elif self.device.type != "cpu":
            self.model.to("cpu")
        self._weights_dropped = level == 2
        self.asleep.add("weights")

    def wakeup(self, tags: Iterable[str], load_model: Callable[[], torch.nn.Module]) -> None:
        """Restore the parts named by `tags`; dropped weights come from `load_model()`. Once every part is
        awake, the decode path bakes in the new ones (it held the old cache and weights)."""
        tags = set(tags)
        was_asleep = bool(self.asleep)
        if "weights" in tags and "weights" in self.asleep:
            if self._weights_dropped:
                self.model = load_model()
                self.marks_tile_rows = tile_rows.has_tiled_weights(self.model)
                if self.kv_caches is not None:
                    bind_kv_caches(self.model, self.kv_caches)
            else:
                self.model.to(self.device)
            self.asleep.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self.asleep:
            self.allocate_kv_cache()
            self.asleep.discard("kv_cache")
        if was_asleep and not self.asleep and self.decode_path is not None:
            self.decode_path.try_capture(self.model)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks (src -> dst) in every layer: the partial last block of a forked sequence."""
        if not copies or self.kv_caches is None:
            return
        self._zero_blocks_up_to(block for copy in copies for block in copy)
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    def copy_states(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy recurrent-state slots (src -> dst) in every recurrent layer, all read before any is written: a
        forked sequence's."""
        if copies:
            self._hold_state_slots(slot for copy in copies for slot in copy)
            copy_state_slots(self.model, list(copies))

    def keep_states(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy sequences' state slots (src) into snapshot slots (dst): the prefix cache keeps them."""
        if copies:
            self._hold_state_slots(src for src, _ in copies)
            self.snapshot_states = self._grown(self.snapshot_states, (dst for _, dst in copies), bind=False)
            copy_slots_between(self.recurrent_states, self.snapshot_states, list(copies))

    def restore_states(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy snapshot slots (src) into sequences' state slots (dst): they start from a prefix-cache hit."""
        if copies:
            self._hold_state_slots(dst for _, dst in copies)
            copy_slots_between(self.snapshot_states, self.recurrent_states, list(copies))

    def prepare(self, scheduled: Sequence[ScheduledSequence], scores_prompt: Set[str] = frozenset(),
                pools: Mapping[str, range] | None = None, adapter_slots: Sequence[int] | None = None) -> StepInputs:
        """Flatten the scheduled chunks into one batch of new tokens; the sequences in `scores_prompt`
        also keep the hidden states of their prompt positions (`PromptRows`), and those in `pools`
        (prefill-only: they never sample) the hidden states of the positions it maps them to;
        `adapter_slots` gives each chunk's LoRA slot (-1: the base model)."""
        self._zero_blocks_up_to(max(s.seq.block_table) for s in scheduled if s.seq.block_table)
        if self.has_recurrent_state:
            self._hold_state_slots(s.seq.state_slot for s in scheduled)
        pools = pools or {}
        tokens: list[int] = []
        sample_rows: list[int] = []
        sampling: list[ScheduledSequence] = []
        prompt_rows: list[PromptRows] = []
        pooling_rows: list[PromptRows] = []
        prompt_tokens: list[tuple[int, int]] = []
        for s in scheduled:
            if (rows := rows_in(s, len(tokens), range(s.seq.num_prompt_tokens))) is not None:
                prompt_tokens.append((rows.first_row, rows.count))
            if s.seq.seq_id in scores_prompt and (rows := prompt_rows_of(s, len(tokens))) is not None:
                prompt_rows.append(rows)
            if s.seq.seq_id in pools and (rows := rows_in(s, len(tokens), pools[s.seq.seq_id])) is not None:
                pooling_rows.append(rows)
            tokens.extend(s.token_ids)
            if s.samples and s.seq.seq_id not in pools:  # a speculating chunk: each verified position
                sample_rows.extend(range(len(tokens) - 1 - len(s.draft_token_ids), len(tokens)))
                sampling.append(s)
        computed, new, tables, prompt_lens, independent, slots = _attention_rows(scheduled)
        meta = AttentionMetadata.build(computed, new, tables, self.block_size, self.device, prompt_lens=prompt_lens,
                                       rows_independent=independent,
                                       state_slots=slots if self.has_recurrent_state else None)
        inputs = StepInputs(
            input_ids=torch.tensor(tokens, dtype=torch.int64, device=self.device),
            positions=meta.positions(),
            meta=meta,
            sample_indices=torch.tensor(sample_rows, dtype=torch.int64, device=self.device),
            sampling=sampling,
            prompt_rows=tuple(prompt_rows),
            pooling_rows=tuple(pooling_rows),
            lora_rows=_lora_rows(scheduled, adapter_slots),
            prompt_token_spans=tuple(prompt_tokens),
        )
        has_images = any(s.seq.multimodal is not None for s in scheduled)
        return with_images(inputs, scheduled, self.device) if has_images else inputs

    def execute(self, inputs: StepInputs) -> torch.Tensor:
        """Float32 logits [len(inputs.sample_indices), vocab]: one row per sampling chunk, 1 + k for a chunk
        verifying k drafts (empty when nothing samples this step)."""
        return self.forward(inputs).sample

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of hidden states (rows of `StepLogits.prompt_hidden`)."""
        return self._head(hidden)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's float32 logits: every row on the AMX tiles under the ``all`` rule (one loop for
        every row, as the decoder's), else the VNNI loop (the ``prompt`` rule: a row there is no prompt
        token's own, and the VNNI loop is 3x faster at a few rows) (native/tile_rows.py)."""
        head_rows = tile_rows.marked(self.tile_rule, (), hidden.shape[0]) if self.marks_tile_rows else None
        if head_rows is None:  # nothing is marked outside a forward pass: no context to enter every step
            return self.model.compute_logits(hidden)
        with tile_rows.prompt_token_rows(head_rows):
            return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> StepLogits:
        """The step's sampling logits and the hidden states of its prompt and pooling rows."""
        if self.kv_caches is None:
            raise RuntimeError("the KV cache is released (the backend is asleep)")
        extra = {} if inputs.embed_overrides is None else {"embed_overrides": inputs.embed_overrides}
        if self.interrupt is not None:
            inputs.meta.interrupt = self.interrupt.check
        tiled = (tile_rows.marked(self.tile_rule, inputs.prompt_token_spans, inputs.input_ids.shape[0])
                 if self.marks_tile_rows else None)
        with tile_rows.prompt_token_rows(tiled):
            if inputs.lora_rows is not None and self.lora_step is not None:
                hidden = self._forward_with_adapters(inputs, extra)
            else:
                # the decode path (CUDA graphs, the native stack) when the step fits it; None -> the modules
                hidden = self.decode_path.run(self.model, inputs) if self.decode_path is not None else None
                if hidden is None:
                    hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, **extra)
        prompt, pooling = _rows_of(hidden, inputs.prompt_rows), _rows_of(hidden, inputs.pooling_rows)
        if not inputs.sampling:
            return StepLogits(hidden.new_empty((0, 0), dtype=torch.float32), prompt, pooling)
        return StepLogits(self._head(hidden.index_select(0, inputs.sample_indices)), prompt, pooling)


    def _forward_with_adapters(self, inputs: StepInputs, extra: dict) -> torch.Tensor:
        """An eager forward pass whose LoRA layers read each row's slot (graphs baked in no adapter)."""
        self.lora_step.set_rows(inputs.lora_rows, self.device)
        try:
            return self.model(inputs.input_ids, inputs.positions, inputs.meta, **extra)
        finally:
            self.lora_step.clear()


def _attention_rows(scheduled: Sequence[ScheduledSequence]
                    ) -> tuple[list[int], list[int], list[list[int]], list[int], bool, list[int]]:
    """Cached-token counts, new-token counts, block tables and prompt lengths of the step's attention rows:
    a chunk's prompt tokens one row (attended as a chunk), and each of its generated tokens a row of its own
    (a speculating chunk's verified positions, a preempted sequence's recomputed output), so that a
    generated token is attended to exactly as the decode step of one token that made it (the same kernel
    and rounding: greedy output stays token for token, speculating or recomputed); and whether every
    sequence has at most one row (AttentionMetadata.rows_independent); and each row's recurrent-state slot (-1:
    the sequence holds none)."""
    independent = True
    slots: list[int] = []
    computed: list[int] = []
    new: list[int] = []
    tables: list[list[int]] = []
    prompt_lens: list[int] = []
    for s in scheduled:
        end = s.start + s.num_new_tokens
        prompt_end = min(max(s.seq.num_prompt_tokens, s.start), end)
        rows = [(s.start, prompt_end - s.start)] if prompt_end > s.start else []
        rows += [(position, 1) for position in range(prompt_end, end)]
        independent = independent and len(rows) <= 1
        for start, count in rows:
            computed.append(start)
            new.append(count)
            tables.append(s.seq.block_table)
            prompt_lens.append(s.seq.num_prompt_tokens)
            slots.append(-1 if s.seq.state_slot is None else s.seq.state_slot)
    return computed, new, tables, prompt_lens, independent, slots


def _lora_rows(scheduled: Sequence[ScheduledSequence], slots: Sequence[int] | None) -> tuple[int, ...] | None:
    """Each row's slot from each chunk's; None when no chunk uses an adapter."""
    if slots is None or all(slot < 0 for slot in slots):
        return None
    return tuple(slot for s, slot in zip(scheduled, slots, strict=True) for _ in range(s.num_new_tokens))


def _rows_of(hidden: torch.Tensor, rows: Sequence[PromptRows]) -> torch.Tensor | None:
    """The rows of `rows`, concatenated in order (a copy: a captured graph reuses its output buffer)."""
    if not rows:
        return None
    return torch.cat([hidden[r.first_row : r.first_row + r.count] for r in rows])


def _empty_device_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
