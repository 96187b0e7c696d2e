"""Block tables of a model whose every layer attends through a sliding window: blocks no
later query reads are trimmed (the null block takes their place and they are freed), tables
made for KV computed elsewhere start with the null block below the window, and the null
block is never handed out, cached, shared, copied or freed."""

import pytest

from common.prefix_hash import extend_block_hashes, root_hash
from services.scheduler.block_manager import NULL_BLOCK, BlockManager

ROOT = root_hash(b"window")
BS = 4


def tokens(n: int) -> list[int]:
    return list(range(100, 100 + n))


def test_the_null_block_is_reserved_only_in_a_windowed_pool() -> None:
    windowed, plain = BlockManager(8, BS, window=6), BlockManager(8, BS)
    assert (windowed.num_blocks, windowed.num_free_blocks) == (7, 7)
    assert (plain.num_blocks, plain.num_free_blocks) == (8, 8)
    added, _ = windowed.allocate("a", 7 * BS)
    assert NULL_BLOCK not in added and sorted(added) == list(range(1, 8))
    assert NULL_BLOCK in plain.allocate("a", 8 * BS)[0] and not plain.is_null(NULL_BLOCK)
    assert plain.trim("a", 8 * BS) is False  # no window: nothing is ever trimmed
    windowed.check_integrity()
    plain.check_integrity()


@pytest.mark.parametrize(("window", "position", "unread"), [
    (6, 0, 0), (6, 5, 0), (6, 8, 0), (6, 9, 1), (6, 12, 1), (6, 13, 2), (4, 4, 0), (4, 7, 1),
    (1, 4, 1), (1, 3, 0), (40, 39, 0), (40, 44, 1),
])  # fmt: skip
def test_unread_blocks_are_those_wholly_before_the_window(window, position, unread) -> None:
    """A query at p reads keys p - W < k <= p: block i (positions 4i..4i+3) is unread by
    every query from `position` on exactly when 4i + 3 <= position - W."""
    manager = BlockManager(4, BS, window=window)
    assert manager.unread_blocks(position) == unread
    want = sum(1 for i in range(64) if 4 * i + 3 <= position - window)
    assert unread == want


def test_a_decoding_request_holds_the_window_and_one_block() -> None:
    """Decode one token at a time to 8x the window: after every step the request holds at
    most ceil((W - 1) / block) + 1 blocks (W = 8: 3 of the 16 its context spans), the rest
    are free again, and its table keeps its length with the null block in front."""
    window, context = 8, 64
    manager = BlockManager(20, BS, window=window)
    manager.allocate("r", 1)
    most = 0
    for position in range(1, context):
        manager.allocate("r", position + 1, write_from=position)
        manager.trim("r", position)
        most = max(most, manager.num_held("r"))
        assert manager.num_held("r") + manager.num_free_blocks == manager.num_blocks
        manager.check_integrity()
    table = manager.table("r")
    assert len(table) == context // BS
    assert most == -(-(window - 1) // BS) + 1 == 3
    assert table[: manager.unread_blocks(context - 1)] == [NULL_BLOCK] * 14
    held = manager.num_held("r")
    assert held <= 3 and manager.free("r") == held  # only the real blocks are released
    assert manager.num_free_blocks == manager.num_blocks
    manager.check_integrity()


def test_trimmed_blocks_stay_cached_and_the_null_block_is_never_cached_or_shared() -> None:
    manager = BlockManager(10, BS, window=5)
    ids = tokens(16)
    block_hashes = extend_block_hashes([], ids, BS, ROOT)
    manager.allocate("a", 16)
    manager.cache_full_blocks("a", block_hashes, ids, 16)
    assert manager.trim("a", 16) is True  # blocks 0..2 end before 16 - 5 + 1 = 12
    table = manager.table("a")
    assert table[:3] == [NULL_BLOCK] * 3 and table[3] != NULL_BLOCK
    assert manager.trim("a", 16) is False and manager.num_held("a") == 1
    # The freed blocks keep their hashes until reused: a later prompt still hits them.
    assert len(manager.cached_prefix(block_hashes, ids, 16)) == 4
    manager.fork("a", "b")  # shares the real blocks, not the null one
    assert manager.pool.ref_count(table[3]) == 2
    _, copies = manager.allocate("b", 17, write_from=12)  # copy-on-write of block 3 only
    assert [src for src, _ in copies] == [table[3]]
    manager.cache_full_blocks("b", block_hashes, ids, 16)
    assert manager.pool.lookup(block_hashes[0], ids[:BS]) != NULL_BLOCK
    manager.free("a")
    manager.free("b")
    assert manager.num_free_blocks == manager.num_blocks
    manager.check_integrity()


def test_a_table_for_kv_computed_elsewhere_starts_with_the_null_block() -> None:
    """A transfer's or swap-in's destination: the blocks below the window of the next query
    are never allocated (nor moved), cached hits there are not taken; the entries returned
    are those after the hits, aligned with the source's table."""
    manager = BlockManager(12, BS, window=6)
    ids = tokens(12)
    block_hashes = extend_block_hashes([], ids, BS, ROOT)
    manager.allocate("old", 12)
    manager.cache_full_blocks("old", block_hashes, ids, 12)
    manager.free("old")
    hits = manager.cached_prefix(block_hashes, ids, 12)
    # The prefix's last query (11) reads 6..11: block 0 stands as the null block.
    assert len(hits) == 3 and hits[0] == NULL_BLOCK and NULL_BLOCK not in hits[1:]
    free_before = manager.num_free_blocks
    # What placement is told it would consume: only the blocks of the window.
    assert manager.blocks_needed("new", 40, hits=hits, next_position=39) == 2
    assert manager.blocks_needed("new", 40, hits=hits) == 10 - 3 + 2  # all: 2 hits revived
    entries, _ = manager.allocate("new", 40, hits=hits, next_position=39)
    table = manager.table("new")
    skip = manager.unread_blocks(39)  # blocks 0..7 are before 39 - 6 + 1
    assert skip == 8 and table[:skip] == [NULL_BLOCK] * skip
    assert entries == table[len(hits) :]  # aligned after the hits (null ones included)
    assert manager.num_held("new") == 2 == free_before - manager.num_free_blocks
    assert all(manager.pool.ref_count(b) == 0 for b in hits[1:])  # hits below: not taken
    manager.free("new")
    assert manager.num_free_blocks == manager.num_blocks
    manager.check_integrity()


def test_a_prefix_whose_early_blocks_were_evicted_still_hits() -> None:
    """Only the blocks the next query reads must be cached: with a prompt's first blocks
    evicted the prefix still hits, those standing as the null block, which allocating from
    the hits never takes; a gap inside the window ends the hit before it."""
    ids = tokens(32)
    block_hashes = extend_block_hashes([], ids, BS, ROOT)
    manager = BlockManager(12, BS, window=6)
    manager.allocate("c", 28)
    manager.cache_full_blocks("c", block_hashes, ids, 28)
    kept = manager.table("c")
    manager.free("c")
    plain = BlockManager(12, BS)  # the same cache without a window: hits need block 0 on
    plain.allocate("c", 28)
    plain.cache_full_blocks("c", block_hashes, ids, 28)
    plain_kept = plain.table("c")
    plain.free("c")
    for index in range(5):  # blocks 0..4 evicted (as reuse by other requests would)
        manager.pool._uncache(manager.pool.blocks[kept[index]])
        plain.pool._uncache(plain.pool.blocks[plain_kept[index]])
    assert plain.cached_prefix(block_hashes, ids, 31) == []
    # The query at 27 reads 22..27: blocks 5 and 6, both cached; 0..4 are read by nobody.
    hits = manager.cached_prefix(block_hashes, ids, 31)
    assert hits == [NULL_BLOCK] * 5 + kept[5:7]
    manager.allocate("d", 29, write_from=28, hits=hits, next_position=28)
    assert manager.table("d")[:7] == hits and manager.num_held("d") == 3
    manager.check_integrity()
    manager.free("d")
    # A gap inside the window (block 5 evicted too): no prefix ends on cached blocks only.
    manager.pool._uncache(manager.pool.blocks[kept[5]])
    assert manager.cached_prefix(block_hashes, ids, 31) == []
    assert manager.num_free_blocks == manager.num_blocks
    manager.check_integrity()
