"""BlockManager: block accounting, prefix caching, LRU eviction, cache keys, fork, reset."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import core.scheduling.block_manager as block_manager_module
from core.scheduling import BlockManager, Sequence

BS = 16


def make_seq(tokens, seq_id="s", cache_keys=()):
    return Sequence(seq_id, list(tokens), cache_keys=cache_keys)


def compute_all(bm: BlockManager, seq: Sequence, cached=()) -> None:
    """Allocate the rest of ``seq`` and pretend the model computed it."""
    assert bm.allocate(seq, seq.num_tokens - len(cached) * bm.block_size, cached)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_computed_blocks(seq)


def prefill(bm: BlockManager, seq: Sequence) -> list[int]:
    """Match the prefix cache, allocate and compute the whole sequence; return the matched blocks."""
    cached = bm.match_prefix(seq)
    compute_all(bm, seq, cached)
    return cached


def test_allocate_and_free_restore_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(range(10))
    assert bm.allocate(seq, 10)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert bm.num_used_blocks == 3 and bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(3 / 8)
    # Growing by one token inside the last block needs no new block; crossing it does.
    seq.num_computed_tokens = 10
    assert bm.allocate(seq, 2) and len(seq.block_table) == 3
    assert bm.allocate(seq, 3) and len(seq.block_table) == 4
    bm.free(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0


def test_allocate_is_all_or_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq(range(8), "a")
    assert bm.allocate(a, 8)
    b = make_seq(range(100, 113), "b")
    assert not bm.allocate(b, 13)  # needs 4 blocks, 2 left
    assert b.block_table == [] and bm.num_free_blocks == 2
    assert bm.allocate(b, 8)


def test_second_request_gets_the_shared_256_token_prefix():
    bm = BlockManager(num_blocks=64, block_size=BS)
    shared = list(range(1000, 1256))
    first = make_seq(shared + [1, 2, 3], "first")
    assert prefill(bm, first) == []
    second = make_seq(shared + [7, 8, 9, 10], "second")
    cached = prefill(bm, second)
    assert len(cached) == 16 and cached == first.block_table[:16]
    assert second.num_cached_tokens == 256
    assert bm.prefix_cache_queries == 259 + 260
    assert bm.prefix_cache_hits == 256
    for block_id in cached:
        assert bm.ref_count(block_id) == 2


@pytest.mark.parametrize(
    ("second_len", "expected_cached"),
    [
        (257, 256),  # the shared prefix is the whole prompt minus one token
        (256, 240),  # identical prompt at an exact block multiple: the last token must be computed
        (255, 240),
        (272, 256),
        (273, 272),
        (290, 288),
    ],
)
def test_prefix_hits_at_block_boundaries(second_len, expected_cached):
    bm = BlockManager(num_blocks=64, block_size=BS)
    tokens = list(range(5000, 5300))
    first = make_seq(tokens[:290], "first")
    prefill(bm, first)
    bm.free(first)
    second = make_seq(tokens[:second_len], "second")
    cached = prefill(bm, second)
    assert len(cached) * BS == expected_cached == second.num_cached_tokens
    assert second.num_computed_tokens == second_len  # compute_all finished it
    assert bm.prefix_cache_hits == expected_cached


def test_blocks_are_cached_only_once_computed():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(range(12), "a")
    assert bm.allocate(a, 12)
    assert bm.match_prefix(make_seq(range(13), "b")) == []
    a.num_computed_tokens = 6  # one block full and computed, the second half done
    bm.cache_computed_blocks(a)
    assert bm.match_prefix(make_seq(range(13), "b")) == a.block_table[:1]
    a.num_computed_tokens = 12
    bm.cache_computed_blocks(a)
    assert bm.match_prefix(make_seq(range(13), "b")) == a.block_table


def test_freed_blocks_stay_cached_and_are_reused():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(range(9), "a")
    prefill(bm, a)
    table = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2  # the partial block is not cached
    b = make_seq(range(9), "b")
    assert prefill(bm, b) == table[:2]
    assert b.num_cached_tokens == 8


def test_a_cache_reserved_up_front_uses_unused_blocks_before_evicting_cached_ones():
    bm = BlockManager(num_blocks=6, block_size=4, lazy_memory=False)
    a = make_seq(range(8), "a")
    prefill(bm, a)
    a_blocks = list(a.block_table)
    bm.free(a)
    b = make_seq(range(100, 116), "b")  # 4 blocks: exactly the never-used ones
    prefill(bm, b)
    assert not set(b.block_table) & set(a_blocks)
    assert bm.match_prefix(make_seq(range(9), "c")) == a_blocks


def test_memory_follows_the_working_set_with_prefix_caching():
    """180 blocks of distinct content through a 100-block cache, 3 at a time: the blocks ever touched
    stay at CACHE_HEADROOM x 3; the most recently freed of them stay cached."""
    bm = BlockManager(num_blocks=100, block_size=4)
    touched: set[int] = set()
    for i in range(60):
        seq = make_seq(range(1000 * i, 1000 * i + 12), f"s{i}")
        assert prefill(bm, seq) == []
        touched |= set(seq.block_table)
        bm.free(seq)
    assert touched == set(range(block_manager_module.CACHE_HEADROOM * 3))
    assert bm.num_cached_blocks == len(touched) and bm.num_free_blocks == 100
    assert len(prefill(bm, make_seq(range(59000, 59013), "again"))) == 3  # the last one still hits


def test_a_cache_reserved_up_front_caches_in_its_whole_budget():
    bm = BlockManager(num_blocks=100, block_size=4, lazy_memory=False)
    for i in range(30):
        seq = make_seq(range(1000 * i, 1000 * i + 12), f"s{i}")
        prefill(bm, seq)
        bm.free(seq)
    assert bm.num_cached_blocks == 90
    assert len(prefill(bm, make_seq(range(0, 13), "first"))) == 3


def test_past_the_allowance_free_blocks_go_first_then_the_least_recently_freed_cached():
    bm = BlockManager(num_blocks=10, block_size=4)
    a, b = make_seq(range(0, 8), "a"), make_seq(range(100, 108), "b")
    prefill(bm, a)
    prefill(bm, b)  # peak 4 in use: up to 8 blocks may be touched
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    bm.free(a)
    bm.free(b)
    c = make_seq(range(300, 314), "c")  # 4 blocks: the 4 unused ones of the allowance (3 full + 1 partial)
    prefill(bm, c)
    bm.free(c)  # its partial block is free, uncached
    d = make_seq(range(400, 412), "d")  # 3 blocks: the free one, then a's (the least recently freed)
    assert bm.allocate(d, 12)
    assert d.block_table == [7, *reversed(a_blocks)]  # a freed tail first
    assert bm.match_prefix(make_seq(range(100, 109), "pb")) == b_blocks  # still a hit
    assert bm.match_prefix(make_seq(range(0, 9), "pa")) == []


def test_lru_eviction_least_recently_freed_first_and_tail_first():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq(range(0, 8), "a")
    b = make_seq(range(100, 108), "b")
    prefill(bm, a)
    prefill(bm, b)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    bm.free(a)  # a freed first: least recently freed
    bm.free(b)
    probe_a = make_seq(range(0, 9), "pa")
    probe_b = make_seq(range(100, 109), "pb")
    # One new block evicts a's tail block; a's head block still matches.
    c = make_seq(range(200, 204), "c")
    assert bm.allocate(c, 4) and c.block_table == [a_blocks[1]]
    assert bm.match_prefix(probe_a) == a_blocks[:1]
    assert bm.match_prefix(probe_b) == b_blocks
    # The next eviction takes a's head, and only then b's blocks.
    d = make_seq(range(300, 304), "d")
    assert bm.allocate(d, 4) and d.block_table == [a_blocks[0]]
    assert bm.match_prefix(probe_a) == []
    assert bm.match_prefix(probe_b) == b_blocks
    e = make_seq(range(400, 404), "e")
    assert bm.allocate(e, 4) and e.block_table == [b_blocks[1]]
    assert bm.match_prefix(probe_b) == b_blocks[:1]


def test_a_hit_refreshes_lru_position():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq(range(0, 8), "a")
    b = make_seq(range(100, 108), "b")
    prefill(bm, a)
    prefill(bm, b)
    a_blocks, b_blocks = list(a.block_table), list(b.block_table)
    bm.free(a)
    bm.free(b)
    # Reuse a's blocks and free them again: now b's are the least recently freed.
    a2 = make_seq(range(0, 8), "a2")
    assert bm.allocate(a2, 0, bm.match_prefix(make_seq(range(0, 9), "x")))
    assert a2.block_table == a_blocks
    bm.free(a2)
    c = make_seq(range(200, 208), "c")
    assert bm.allocate(c, 8)
    assert sorted(c.block_table) == sorted(b_blocks)
    assert bm.match_prefix(make_seq(range(0, 9), "pa")) == a_blocks


def test_matched_evictable_blocks_are_not_counted_twice():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = make_seq(range(8), "a")
    prefill(bm, a)
    a_blocks = list(a.block_table)
    bm.free(a)  # 2 evictable + 1 free
    b = make_seq(list(range(8)) + [50, 51, 52, 53, 54], "b")  # 13 tokens: 4 blocks, 2 of them cached
    cached = bm.match_prefix(b)
    assert len(cached) == 2
    assert not bm.allocate(b, 5, cached)  # would have to evict its own cached blocks
    assert b.block_table == [] and bm.num_free_blocks == 3 and bm.num_cached_blocks == 2
    c = make_seq(list(range(8)) + [50, 51, 52, 53], "c")  # 12 tokens: 2 cached + 1 new
    cached = bm.match_prefix(c)
    assert bm.allocate(c, 4, cached)
    assert c.block_table[:2] == a_blocks
    assert c.num_computed_tokens == 8 and bm.num_free_blocks == 0


def test_cache_keys_change_the_hash_of_overlapping_blocks():
    bm = BlockManager(num_blocks=32, block_size=4)
    tokens = list(range(20))
    # An "image" over positions 9..14: blocks 2 and 3 overlap it.
    a = make_seq(tokens, "a", cache_keys=[(9, 14, "img-A")])
    prefill(bm, a)
    same = make_seq(tokens, "same", cache_keys=[(9, 14, "img-A")])
    assert bm.match_prefix(same) == a.block_table[:4]
    other = make_seq(tokens, "other", cache_keys=[(9, 14, "img-B")])
    assert bm.match_prefix(other) == a.block_table[:2]
    plain = make_seq(tokens, "plain")
    assert bm.match_prefix(plain) == a.block_table[:2]
    moved = make_seq(tokens, "moved", cache_keys=[(8, 13, "img-A")])
    assert bm.match_prefix(moved) == a.block_table[:2]


def test_each_block_is_hashed_once(monkeypatch):
    calls = []
    real = block_manager_module.hash_block

    def counting(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(block_manager_module, "hash_block", counting)
    bm = BlockManager(num_blocks=64, block_size=4)
    seq = make_seq(range(10), "s")
    probe = make_seq(range(10), "probe")
    assert bm.allocate(seq, 10, bm.match_prefix(seq))
    for step in range(40):  # decode one token at a time
        seq.num_computed_tokens = seq.num_tokens
        bm.cache_computed_blocks(seq)
        seq.append_token(1000 + step)
        assert bm.allocate(seq, 1)
        assert len(bm.match_prefix(probe)) == 2
    assert len(calls) == seq.num_computed_tokens // 4 + 2  # + the probe's 2 blocks, hashed once


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = make_seq(range(10), "p")
    compute_all(bm, parent)
    parent.append_token(99)
    child = parent.fork("c")
    copies = bm.fork(parent, child)
    assert child.block_table[:2] == parent.block_table[:2]
    assert child.block_table[2] != parent.block_table[2]
    assert copies == [(parent.block_table[2], child.block_table[2])]
    assert child.num_computed_tokens == 10 and child.token_ids == parent.token_ids
    assert [bm.ref_count(b) for b in parent.block_table] == [2, 2, 1]
    assert bm.ref_count(child.block_table[2]) == 1
    bm.free(parent)
    assert [bm.ref_count(b) for b in child.block_table] == [1, 1, 1]
    bm.free(child)
    assert bm.num_free_blocks == 8


def test_fork_at_a_block_boundary_needs_no_copy():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = make_seq(range(8), "p")
    compute_all(bm, parent)
    child = parent.fork("c")
    assert bm.fork(parent, child) == []
    assert child.block_table == parent.block_table and child.num_computed_tokens == 8


def test_fork_without_a_free_block_recomputes_the_partial_block():
    bm = BlockManager(num_blocks=3, block_size=4)
    parent = make_seq(range(10), "p")
    compute_all(bm, parent)
    child = parent.fork("c")
    assert bm.fork(parent, child) == []
    assert child.block_table == parent.block_table[:2] and child.num_computed_tokens == 8


def test_reset_drops_the_cache_and_refuses_while_blocks_are_held():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(range(9), "a")
    prefill(bm, a)
    with pytest.raises(RuntimeError):
        bm.reset()
    bm.free(a)
    assert bm.num_cached_blocks == 2
    bm.reset()
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 8
    assert bm.match_prefix(make_seq(range(9), "b")) == []


def test_duplicate_content_is_cached_once():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(range(9), "a")
    b = make_seq(range(9), "b")
    assert bm.allocate(a, 9) and bm.allocate(b, 9)  # both miss: computed concurrently
    for seq in (a, b):
        seq.num_computed_tokens = 9
        bm.cache_computed_blocks(seq)
    assert bm.num_cached_blocks == 2
    assert bm.match_prefix(make_seq(range(9), "c")) == a.block_table[:2]
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2


def test_prefix_caching_disabled():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_seq(range(9), "a")
    prefill(bm, a)
    bm.free(a)
    assert bm.match_prefix(make_seq(range(9), "b")) == []
    assert bm.num_cached_blocks == 0 and bm.prefix_cache_queries == 0


def test_scheduling_package_never_imports_torch_or_numpy():
    package = Path(block_manager_module.__file__).parent
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in {"torch", "numpy"}, f"{path.name} imports {name}"
