"""A request's token stream and its place in the paged KV cache."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Hashable, Iterable
from typing import Any

# Process-wide arrival counter: preemption picks the most recently arrived
# running sequence, so arrival order must be total and never repeat.
_arrival_counter = itertools.count()

CacheKeySpan = tuple[int, int, Hashable]
AtomicSpan = tuple[int, int]


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life: queued, being computed, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One generation stream: prompt plus generated tokens and its KV blocks.

    ``num_computed_tokens`` counts the tokens whose KV is in the cache
    (``block_table`` covers at least those).  ``num_cached_tokens`` is the
    number of prompt tokens served from the prefix cache when the sequence was
    first given blocks, for reporting to users.

    ``cache_keys`` are ``(start, end, key)`` spans over token positions
    ``[start, end)`` (for example an image's content hash over its placeholder
    tokens).  Each key is folded into the hash of every block overlapping its
    span, so identical placeholder tokens with different image content never
    share cache blocks.  Keys should be ``str``, ``bytes`` or ``int`` (they are
    hashed through their ``repr``).

    ``block_hashes`` and ``num_registered_blocks`` are bookkeeping of the
    :class:`~core.scheduling.block_manager.BlockManager`: the content hashes of
    the sequence's full blocks (computed once, valid for as long as tokens are
    only appended) and how many of its blocks were offered to the prefix cache.

    ``multimodal`` is an opaque payload of the backend (e.g. image embeddings
    and their positions).  It lives as long as the sequence, so a preempted
    sequence recomputes with it, and forks share it.

    ``atomic_spans`` are sorted, disjoint ``[start, end)`` prompt ranges that
    one forward chunk must compute whole: the tokens of a Gemma 3 image attend
    to each other both ways, so a chunk that stopped inside one would compute
    its first tokens without seeing the rest.  The scheduler never ends a
    chunk strictly inside a span (see ``Scheduler``).

    ``skip_reading_prefix_cache`` makes the sequence compute every token even when
    a prefix of it is cached (a request that needs the logits of its prompt
    positions); its own full blocks are still offered to the cache.

    ``state_slot`` is the slot of the model's recurrent state the sequence
    holds while it runs (``StateSlots``); None for a model without recurrent
    layers, and while the sequence waits.
    """

    def __init__(
        self,
        seq_id: str,
        prompt_token_ids: Iterable[int],
        cache_keys: Iterable[CacheKeySpan] = (),
        arrival_order: int | None = None,
        multimodal: Any = None,
        atomic_spans: Iterable[AtomicSpan] = (),
        skip_reading_prefix_cache: bool = False,
    ) -> None:
        self.seq_id = seq_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        if not self.prompt_token_ids:
            raise ValueError(f"sequence {seq_id!r} has an empty prompt")
        self.token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.status = SequenceStatus.WAITING
        self.arrival_order = next(_arrival_counter) if arrival_order is None else arrival_order
        # Sorted by start so block hashing can stop scanning early.
        self.cache_keys: tuple[CacheKeySpan, ...] = tuple(sorted(cache_keys, key=lambda s: (s[0], s[1])))
        for start, end, _ in self.cache_keys:
            if not 0 <= start <= end:
                raise ValueError(f"sequence {seq_id!r}: bad cache_keys span [{start}, {end})")
        self.block_hashes: list[bytes] = []
        self.num_registered_blocks = 0
        self.multimodal = multimodal
        self.atomic_spans = _checked_atomic_spans(seq_id, atomic_spans, len(self.prompt_token_ids))
        self.skip_reading_prefix_cache = skip_reading_prefix_cache
        self.state_slot: int | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Number of prompt tokens."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Number of generated tokens."""
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens (a copy)."""
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        """True once the sequence was finished or aborted."""
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        """Append one generated token (its KV is computed at the next step)."""
        self.token_ids.append(token_id)

    def fork(self, seq_id: str) -> Sequence:
        """A copy of this sequence's tokens under a new id, holding no blocks.

        Give it blocks with ``Scheduler.fork`` / ``BlockManager.fork``, which
        share the parent's computed KV.  The copy arrives now (it is preempted
        before its parent).
        """
        child = Sequence(seq_id, self.prompt_token_ids, self.cache_keys, multimodal=self.multimodal,
                         atomic_spans=self.atomic_spans, skip_reading_prefix_cache=self.skip_reading_prefix_cache)
        child.token_ids = list(self.token_ids)
        child.num_cached_tokens = self.num_cached_tokens
        # Same tokens, same content hashes: no need to hash them again.
        child.block_hashes = list(self.block_hashes)
        return child

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )


def _checked_atomic_spans(seq_id: str, spans: Iterable[AtomicSpan], prompt_len: int) -> tuple[AtomicSpan, ...]:
    """``spans`` as a sorted tuple; ValueError unless each is a non-empty prompt range, disjoint from the rest."""
    checked = tuple(sorted((int(start), int(end)) for start, end in spans))
    previous_end = 0
    for start, end in checked:
        if not previous_end <= start < end <= prompt_len:
            raise ValueError(
                f"sequence {seq_id!r}: atomic_spans must be disjoint, non-empty ranges inside the "
                f"{prompt_len}-token prompt, got {list(checked)}"
            )
        previous_end = end
    return checked
