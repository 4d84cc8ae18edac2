"""What one forward step's attention needs to know about its flat batch of new tokens."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """One step's flat batch of new tokens, laid out sequence after sequence.

    The tensors live on the model's device; the ``*_list`` copies let the CPU path (and any
    Python-side bookkeeping) avoid ``.tolist()`` device syncs.
    """

    slot_mapping: torch.Tensor  # [T] int64: block * block_size + offset of each new token; < 0 = skip
    query_start_loc: torch.Tensor  # [B + 1] int32: cumulative new-token counts
    seq_lens: torch.Tensor  # [B] int32: cached + new tokens of each sequence after this step
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    query_lens_list: list[int]
    seq_lens_list: list[int]
    block_size: int
    is_decode: bool  # every sequence brings exactly one new token, none of them a prompt's (decode_sequences)
    # Per sequence, [start, end) spans whose tokens attend to each other both ways (Gemma 3 images);
    # None for plain causal attention. Only the reference paged attention reads it.
    bidirectional_spans: list[tuple[tuple[int, int], ...]] | None = None
    # Sequences whose one new token is a prompt token (the rest of the prompt cached, or a chunk cut one token
    # short): attended as a chunk, not a decode row (decode_sequences).
    prompt_singletons: frozenset[int] = frozenset()
    # False when a sequence brings several rows (the model runner's rows of one token each for a speculating
    # chunk's verified positions or a preempted sequence's recomputed output): a later row attends to the K/V an
    # earlier row of the same step writes, so every layer must take the rows together, never groups of rows
    # layer by layer apart (the native decode stack's row-group path).
    rows_independent: bool = True
    # Each row's recurrent-state slot (layers/recurrent.py): the scheduler's slot of the row's sequence; None
    # when the model has no recurrent layer.
    state_slots: tuple[int, ...] | None = None
    # Per-step scratch an op set fills at the first layer and reuses in the others (index tensors,
    # masks): this object lives for one forward step.
    op_cache: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)
    # What each attention layer calls before it runs: it raises to drop a step whose requests are all being
    # aborted (step_interrupt.py). Set by the runner for the step it runs; never copied to another rank.
    interrupt: Callable[[], None] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_list)

    @property
    def context_lens_list(self) -> list[int]:
        """Tokens already in the cache before this step, per sequence."""
        return [s - q for s, q in zip(self.seq_lens_list, self.query_lens_list, strict=True)]

    def row_starts(self) -> list[int]:
        """Each sequence's first row in the flat batch of new tokens (query_start_loc's values, on the host)."""
        starts = [0]
        for q_len in self.query_lens_list[:-1]:
            starts.append(starts[-1] + q_len)
        return starts

    def decode_sequences(self) -> list[int]:
        """The sequences attended as decode rows: one new token, a generated one. A prompt token alone in
        its chunk is attended as a chunk (as the rest of its prompt was), since the decode kernels do not
        round as the chunk kernels do and a prompt row's results must not depend on how much of the prompt
        was cached or where a chunk ended."""
        return [b for b, q in enumerate(self.query_lens_list) if q == 1 and b not in self.prompt_singletons]

    def chunk_sequences(self) -> list[int]:
        """The sequences attended as chunks (every one with new tokens that decode_sequences leaves)."""
        decode = set(self.decode_sequences())
        return [b for b, q in enumerate(self.query_lens_list) if q > 0 and b not in decode]

    def positions(self) -> torch.Tensor:
        """[T] int64 positions of the new tokens (context length + index in the chunk)."""
        pos = [
            c + i for c, q in zip(self.context_lens_list, self.query_lens_list, strict=True) for i in range(q)
        ]
        return torch.tensor(pos, dtype=torch.int64, device=self.slot_mapping.device)

    def last_token_indices(self) -> torch.Tensor:
        """[B] int64 index into the flat batch of each sequence's last new token."""
        return (self.query_start_loc[1:] - 1).to(torch.int64)

    @classmethod
    def build(
        cls,
        num_computed: Sequence[int],
        num_new: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        prompt_lens: Sequence[int] | None = None,
        rows_independent: bool = True,
        state_slots: Sequence[int] | None = None,
    ) -> AttentionMetadata:
        """From per-sequence cached-token counts, new-token counts and block tables; ``prompt_lens`` (per
        sequence, its prompt's tokens) tells a prompt token alone in its chunk from a decode row;
        ``rows_independent`` False says that some "sequences" here are rows of one sequence; ``state_slots``
        (per sequence) their recurrent-state slots."""
        if not (len(num_computed) == len(num_new) == len(block_tables)):
            raise ValueError("num_computed, num_new and block_tables must have one entry per sequence")
        if state_slots is not None and len(state_slots) != len(num_new):
            raise ValueError("state_slots must have one entry per sequence")
        seq_lens = [c + n for c, n in zip(num_computed, num_new, strict=True)]
        slots = _slot_mapping(num_computed, num_new, block_tables, block_size)
        width = max(max((len(t) for t in block_tables), default=0), 1)
        rows = [[*row, *[0] * (width - len(row))] for row in block_tables]  # one tensor, not one per row
        table = torch.tensor(rows, dtype=torch.int32).view(len(rows), width)
        starts = [0]
        for n in num_new:
            starts.append(starts[-1] + n)
        singletons = frozenset(b for b, (c, n, p) in enumerate(zip(num_computed, num_new, prompt_lens or (), strict=False))
                               if n == 1 and c < p)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=table.to(device),
            max_query_len=max(num_new, default=0),
            max_seq_len=max(seq_lens, default=0),
            query_lens_list=list(num_new),
            seq_lens_list=seq_lens,
            block_size=block_size,
            is_decode=all(n == 1 for n in num_new) and not singletons,
            prompt_singletons=singletons,
            rows_independent=rows_independent,
            state_slots=None if state_slots is None else tuple(state_slots),
        )


def _slot_mapping(num_computed, num_new, block_tables, block_size) -> list[int]:
    slots = []
    for computed, new, table in zip(num_computed, num_new, block_tables, strict=True):
        needed = -(-(computed + new) // block_size)
        if len(table) < needed:
            raise ValueError(
                f"block table has {len(table)} blocks, {needed} needed for {computed + new} tokens"
            )
        for pos in range(computed, computed + new):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
    return slots
