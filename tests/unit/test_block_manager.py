"""Block pool and block tables: ref counts, the LRU free queue, the prefix-cache index,
copy-on-write, and the integrity check."""

import pytest

from common.prefix_hash import extend_block_hashes, root_hash
from services.scheduler.block_manager import BlockManager, BlockPool, NoFreeBlocksError

ROOT = root_hash(b"test-salt")


def hashes(tokens, block_size=4, root=ROOT):
    return extend_block_hashes([], tokens, block_size, root)


def test_allocate_and_free_return_blocks_in_lru_order():
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.num_free == 1
    pool.decref([1])
    pool.decref([0, 2])
    assert pool.num_free == 4
    # Freed blocks join the tail: the never-used block 3 comes first, then in free order.
    assert pool.allocate(4) == [3, 1, 0, 2]
    pool.check_integrity()


def test_allocating_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(2)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(3)
    assert pool.num_free == 2
    pool.check_integrity()


def test_shared_block_is_freed_only_by_its_last_owner():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.incref([block])
    assert pool.ref_count(block) == 2
    pool.decref([block])
    assert pool.num_free == 1
    pool.decref([block])
    assert pool.num_free == 2
    with pytest.raises(ValueError, match="freed twice"):
        pool.decref([block])


def test_incref_of_free_block_is_rejected():
    with pytest.raises(ValueError, match="is free"):
        BlockPool(1).incref([0])


def test_block_table_grows_by_whole_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate("a", 5) == ([0, 1], [])
    assert bm.allocate("a", 8) == ([], [])  # still fits in two blocks
    assert bm.allocate("a", 9) == ([2], [])
    assert bm.table("a") == [0, 1, 2]
    assert bm.blocks_needed("a", 16) == 1
    assert bm.can_allocate("b", 20) is True
    assert bm.can_allocate("b", 21) is False
    assert bm.can_allocate("b", 16, reserve=1) is True
    assert bm.can_allocate("b", 17, reserve=1) is False
    bm.check_integrity()
    assert bm.free("a") == 3
    assert bm.num_free_blocks == 8
    assert bm.free("a") == 0
    bm.check_integrity()


def test_full_computed_blocks_are_cached_and_hit_with_token_comparison():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(10))  # blocks [0..3] [4..7] and a partial [8, 9]
    bm.allocate("a", 10)
    bm.cache_full_blocks("a", hashes(tokens), tokens, num_computed_tokens=10)
    assert bm.pool.num_cached == 2  # the partial block is never cached
    a_table = bm.table("a")
    assert bm.cached_prefix(hashes(tokens), tokens, max_tokens=9) == a_table[:2]
    # A lookup never returns more than max_tokens worth of blocks.
    assert bm.cached_prefix(hashes(tokens), tokens, max_tokens=7) == a_table[:1]
    # Same prefix, different continuation: only the shared first block hits.
    other = tokens[:4] + [99, 98, 97, 96]
    assert bm.cached_prefix(hashes(other), other, max_tokens=8) == a_table[:1]
    bm.check_integrity()


def test_not_yet_computed_blocks_are_not_cached():
    bm = BlockManager(num_blocks=8, block_size=4)
    tokens = list(range(12))
    bm.allocate("a", 12)
    bm.cache_full_blocks("a", hashes(tokens), tokens, num_computed_tokens=6)
    assert bm.pool.num_cached == 1  # only block 0 is full AND computed


def test_hash_collision_is_caught_by_the_token_comparison():
    bm = BlockManager(num_blocks=4, block_size=4)
    tokens = [1, 2, 3, 4]
    bm.allocate("a", 4)
    bm.cache_full_blocks("a", hashes(tokens), tokens, 4)
    forged = [5, 6, 7, 8]  # pretend these tokens collided onto the same hash
    assert bm.cached_prefix(hashes(tokens), forged, max_tokens=4) == []


def test_salts_separate_cache_entries():
    bm = BlockManager(num_blocks=4, block_size=4)
    tokens = [1, 2, 3, 4, 5]
    bm.allocate("a", 5)
    bm.cache_full_blocks("a", hashes(tokens), tokens, 5)
    tenant = root_hash(b"test-salt", cache_salt="tenant-b")
    assert bm.cached_prefix(hashes(tokens, root=tenant), tokens, 4) == []
    other_deployment = root_hash(b"other-salt")
    assert bm.cached_prefix(hashes(tokens, root=other_deployment), tokens, 4) == []
    assert bm.cached_prefix(hashes(tokens), tokens, 4) == bm.table("a")[:1]


def test_hits_revive_free_cached_blocks_and_eviction_is_lru():
    bm = BlockManager(num_blocks=4, block_size=2)
    old, new = [1, 2, 3, 4], [5, 6, 7, 8]
    bm.allocate("old", 4)
    bm.cache_full_blocks("old", hashes(old, 2), old, 4)
    bm.allocate("new", 4)
    bm.cache_full_blocks("new", hashes(new, 2), new, 4)
    bm.free("old")
    bm.free("new")
    assert bm.num_free_blocks == 4 and bm.pool.num_cached == 4  # free but still cached
    # A hit on "new" takes its blocks out of the free queue (and counts against capacity).
    hits = bm.cached_prefix(hashes(new, 2), new, 4)
    assert len(hits) == 2
    assert bm.blocks_needed("again", 4, hits=hits) == 2
    bm.allocate("again", 4, hits=hits)
    assert bm.table("again") == hits and bm.num_free_blocks == 2
    # Allocating evicts the least recently freed cached block first: "old"'s tail block
    # (tables are freed tail first, so a prefix keeps its head longest).
    fresh, _ = bm.allocate("x", 2)
    assert fresh == [1] and bm.pool.num_evictions == 1
    assert bm.cached_prefix(hashes(old, 2), old, 4) == [0]
    bm.check_integrity()


def test_freeing_returns_tail_blocks_to_the_queue_first():
    bm = BlockManager(num_blocks=3, block_size=2)
    bm.allocate("a", 6)
    table = bm.table("a")
    bm.free("a")
    # Tail first: the last block of the sequence is the first to be reused.
    assert bm.pool.allocate(3) == list(reversed(table))


def test_fork_shares_blocks_and_copy_on_write_splits_the_written_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    bm.allocate("parent", 6)  # one full block, one partial
    bm.fork("parent", "child")
    parent = bm.table("parent")
    assert bm.table("child") == parent
    assert all(bm.pool.ref_count(b) == 2 for b in parent)
    # The child writes token 6 into the shared partial block: it gets its own copy.
    assert bm.blocks_needed("child", 7, write_from=6) == 1
    new, copies = bm.allocate("child", 7, write_from=6)
    child = bm.table("child")
    assert new == [] and copies == [(parent[1], child[1])]
    assert child[0] == parent[0] and child[1] != parent[1]
    assert bm.pool.ref_count(parent[0]) == 2 and bm.pool.ref_count(parent[1]) == 1
    # The parent now owns its partial block alone: no copy when it writes.
    assert bm.allocate("parent", 7, write_from=6) == ([], [])
    bm.check_integrity()
    bm.free("child")
    bm.free("parent")
    assert bm.num_free_blocks == 8
    bm.check_integrity()


def test_integrity_check_catches_corruption():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("a", 8)
    bm._tables["a"].append(3)  # a block the pool thinks is free
    with pytest.raises(AssertionError, match="block 3"):
        bm.check_integrity()
    bm2 = BlockManager(num_blocks=4, block_size=4)
    tokens = [1, 2, 3, 4]
    bm2.allocate("a", 4)
    bm2.cache_full_blocks("a", hashes(tokens), tokens, 4)
    bm2.pool.blocks[bm2.table("a")[0]].block_hash = b"x" * 32
    with pytest.raises(AssertionError, match="hash"):
        bm2.check_integrity()


def test_caching_can_be_switched_off():
    bm = BlockManager(num_blocks=4, block_size=4, enable_caching=False)
    tokens = [1, 2, 3, 4, 5]
    bm.allocate("a", 5)
    bm.cache_full_blocks("a", hashes(tokens), tokens, 5)
    assert bm.pool.num_cached == 0
    assert bm.cached_prefix(hashes(tokens), tokens, 4) == []


def test_hash_chain_is_stable_and_depends_on_every_earlier_token():
    a = hashes(list(range(12)))
    assert a == hashes(list(range(12)))  # deterministic (no Python hash())
    b = hashes([99] + list(range(1, 12)))
    assert all(x != y for x, y in zip(a, b, strict=True))  # a change in block 0 changes all
    assert len(a[0]) == 32


def test_invalid_geometry_is_a_value_error():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks=0, block_size=16)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(num_blocks=4, block_size=0)
