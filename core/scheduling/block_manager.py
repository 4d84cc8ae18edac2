"""Reference-counted paged-KV blocks with hash-chained prefix caching."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence as SequenceABC

from core.scheduling.sequence import Sequence

# With lazy memory, blocks ever touched may reach this many times the peak in use (the rest caches).
CACHE_HEADROOM = 2

# Parent "hash" of a sequence's first block: fixed width keeps the hashed byte
# layout unambiguous (parent digest | token ids | cache keys).
_ROOT_HASH = bytes(32)


def hash_block(parent: bytes, token_ids: SequenceABC[int], cache_keys: SequenceABC[tuple]) -> bytes:
    """Content hash of one full block, chained to the hash of the block before it.

    SHA-256 rather than ``hash()`` so that two different prefixes colliding (and
    silently sharing wrong KV) is not a practical concern.
    """
    h = hashlib.sha256(parent)
    h.update(array("q", token_ids).tobytes())
    for span in cache_keys:
        h.update(repr(span).encode())
    return h.digest()


class _Block:
    """Bookkeeping of one physical KV block."""

    __slots__ = ("block_id", "ref_count", "hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        # Set only while the block is registered in the prefix-cache hash table.
        self.hash: bytes | None = None


class BlockManager:
    """Hands out fixed-size KV blocks to sequences and caches full blocks by content.

    A block is in exactly one of four states: *used* (ref count > 0), *unused*
    (never handed out since the start or the last reset), *free* (ref count 0,
    no hash: its content is not worth keeping) or *evictable* (ref count 0,
    registered in the hash table; reused on a prefix hit, otherwise recycled
    least-recently-freed first).  ``num_free_blocks`` counts all but used ones.

    New content goes to a free block first.  Then, with ``lazy_memory`` (a
    cache whose memory is reached as blocks are first used: the CPU's), an
    unused block only while the blocks ever touched stay under
    ``CACHE_HEADROOM`` times the peak number in use at once, else the least
    recently freed evictable block: resident memory follows the working set,
    and the prefix cache keeps about as many freed blocks as that peak.
    Without it (a cache reserved up front: a GPU's), unused blocks go first
    and cached content is evicted only when none is left: the whole budget
    caches.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, *,
                 lazy_memory: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.lazy_memory = lazy_memory
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._init_blocks()

    def _init_blocks(self) -> None:
        self._blocks = [_Block(i) for i in range(self.num_blocks)]
        # Reversed so that pop() hands out low block ids first (easier to read in logs).
        self._unused: list[int] = list(range(self.num_blocks - 1, -1, -1))
        self._free: list[int] = []
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_to_block: dict[bytes, int] = {}
        self._peak_used = 0

    # ------------------------------------------------------------------ stats

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take: unused, free and evictable cached blocks."""
        return len(self._unused) + len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences, 0..1."""
        return self.num_used_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix-cache hash table (used or evictable)."""
        return len(self._hash_to_block)

    def ref_count(self, block_id: int) -> int:
        """How many block tables hold ``block_id``."""
        return self._blocks[block_id].ref_count

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    # ---------------------------------------------------------------- hashing

    def block_hash(self, seq: Sequence, index: int) -> bytes:
        """Content hash of the sequence's full block ``index``, computed once per block."""
        hashes = seq.block_hashes
        bs = self.block_size
        if (index + 1) * bs > seq.num_tokens:
            raise ValueError(f"block {index} of {seq.seq_id!r} is not full")
        while len(hashes) <= index:
            i = len(hashes)
            start, end = i * bs, (i + 1) * bs
            keys = [span for span in seq.cache_keys if span[0] < end and span[1] > start]
            parent = hashes[-1] if hashes else _ROOT_HASH
            hashes.append(hash_block(parent, seq.token_ids[start:end], keys))
        return hashes[index]

    # ------------------------------------------------------------- lifecycle

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Longest chain of cached full blocks that prefixes ``seq`` (which holds no blocks).

        Never covers the last token: the model must compute at least one token
        to produce logits, so only blocks ending at or before
        ``num_tokens - 1`` can match.  Pass the result to :meth:`allocate`.
        Nothing matches for a sequence with ``skip_reading_prefix_cache``.
        """
        if not self.enable_prefix_caching or seq.skip_reading_prefix_cache:
            return []
        matched: list[int] = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            block_id = self._hash_to_block.get(self.block_hash(seq, i))
            if block_id is None:
                break
            matched.append(block_id)
        return matched

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: SequenceABC[int] = ()) -> bool:
        """Grow ``seq``'s table to cover ``num_computed_tokens + num_new_tokens`` tokens.

        On the first allocation (empty table) ``cached_blocks`` from
        :meth:`match_prefix` are taken as already computed, setting
        ``num_computed_tokens`` (and, unless the sequence was preempted before,
        ``num_cached_tokens``).  All-or-nothing: returns False and changes
        nothing if there are not enough free and evictable blocks.
        """
        first = not seq.block_table
        if cached_blocks and not first:
            raise ValueError(
                f"{seq.seq_id!r} already holds blocks; cached blocks apply to a first allocation"
            )
        num_computed = len(cached_blocks) * self.block_size if cached_blocks else seq.num_computed_tokens
        total = self.num_blocks_for(num_computed + num_new_tokens)
        num_new_blocks = total - len(seq.block_table) - len(cached_blocks)
        # Matched blocks sitting in the evictable list are about to be taken
        # back, so they cannot also serve as fresh blocks for this request.
        reclaimed = sum(1 for b in cached_blocks if self._blocks[b].ref_count == 0)
        if num_new_blocks > self.num_free_blocks - reclaimed:
            return False
        for block_id in cached_blocks:
            self._take_cached(block_id)
        seq.block_table.extend(cached_blocks)
        seq.block_table.extend(self._take_new() for _ in range(num_new_blocks))
        if first:
            self._on_first_allocation(seq, len(cached_blocks) * self.block_size)
        return True

    def _on_first_allocation(self, seq: Sequence, num_cached: int) -> None:
        seq.num_computed_tokens = num_cached
        if seq.num_preemptions == 0:
            # Resuming after preemption recomputes from cache too, but the
            # user-facing figure is about the prompt as first served.
            seq.num_cached_tokens = min(num_cached, seq.num_prompt_tokens)
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += num_cached

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register the hashes of ``seq``'s blocks that are now full and computed."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        for i in range(seq.num_registered_blocks, num_full):
            block = self._blocks[seq.block_table[i]]
            if block.hash is not None:
                continue  # came from the cache or is shared with a fork parent
            h = self.block_hash(seq, i)
            # Another sequence computed the same content first: keep its
            # block as the cached copy; this one is freed plainly later.
            if h not in self._hash_to_block:
                block.hash = h
                self._hash_to_block[h] = block.block_id
        seq.num_registered_blocks = max(seq.num_registered_blocks, num_full)

    def trim(self, seq: Sequence) -> None:
        """Release the blocks of ``seq`` past its computed tokens (they held rejected speculative drafts
        only: never registered, never shared), so its table covers exactly its computed KV."""
        keep = self.num_blocks_for(seq.num_computed_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks and clear its table (its KV is gone: computed = 0)."""
        # Tail first, so that a sequence's last blocks (least likely to be
        # shared) are evicted before its prefix.
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]]:
        """Give ``child`` (same tokens as ``parent``, no blocks) the parent's computed KV.

        Full computed blocks are shared (copy-on-write is never needed: nobody
        writes them again).  The partially filled last block gets a fresh copy;
        the returned ``(src, dst)`` block copies must be done by the model
        runner before the next forward.  Without a free block for the copy the
        child simply recomputes the tokens of that partial block.
        """
        if child.block_table:
            raise ValueError(f"fork target {child.seq_id!r} already holds blocks")
        num_full = parent.num_computed_tokens // self.block_size
        shared = parent.block_table[:num_full]
        for block_id in shared:
            self._blocks[block_id].ref_count += 1
        child.block_table = list(shared)
        child.num_computed_tokens = num_full * self.block_size
        child.num_registered_blocks = min(parent.num_registered_blocks, num_full)
        copies: list[tuple[int, int]] = []
        has_partial = parent.num_computed_tokens % self.block_size and len(parent.block_table) > num_full
        if has_partial and self.num_free_blocks > 0:
            dst = self._take_new()
            child.block_table.append(dst)
            child.num_computed_tokens = parent.num_computed_tokens
            copies.append((parent.block_table[num_full], dst))
        return copies

    def reset(self) -> None:
        """Drop every block and the whole hash table (the KV memory was released).

        Only valid while no sequence holds blocks.
        """
        held = self.num_used_blocks
        if held:
            raise RuntimeError(f"cannot reset the block manager: {held} blocks are still held")
        self._init_blocks()

    # --------------------------------------------------------------- helpers

    def _take_cached(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._evictable[block_id]
        block.ref_count += 1

    def _take_new(self) -> int:
        """A block for new content, in the order the class docstring gives."""
        self._peak_used = max(self._peak_used, self.num_used_blocks + 1)
        if self._free:
            block_id = self._free.pop()
        elif self._evictable and (not self._unused or self._touched_enough()):
            block_id = self._evict()
        else:
            block_id = self._unused.pop()
        self._blocks[block_id].ref_count = 1
        return block_id

    def _touched_enough(self) -> bool:
        """Lazy memory only: the blocks ever touched reached their allowance (see the class docstring)."""
        touched = self.num_blocks - len(self._unused)
        return self.lazy_memory and touched >= CACHE_HEADROOM * self._peak_used

    def _evict(self) -> int:
        """Drop the least recently freed cached block from the hash table; its id."""
        block_id, _ = self._evictable.popitem(last=False)
        block = self._blocks[block_id]
        assert block.hash is not None
        del self._hash_to_block[block.hash]
        block.hash = None
        return block_id

    def _release(self, block_id: int) -> None:
        block = self._blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} released more often than taken"
        if block.ref_count == 0:
            if block.hash is not None:
                self._evictable[block_id] = None
            else:
                self._free.append(block_id)
