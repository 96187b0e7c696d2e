"""Block tables of a model with several KV groups (vLLM's hybrid KV cache manager): one
flat, interleaved table per request (entry i * groups + g: group g's i-th block), windowed
groups trimmed while full groups keep every block, prefix hits that need the full groups'
whole prefix and the windowed groups' window, copy-on-write and forks per entry."""

import pytest

from common.prefix_hash import extend_block_hashes, root_hash
from services.scheduler.block_manager import NULL_BLOCK, BlockManager

ROOT = root_hash(b"groups")
BS = 4
WINDOWS = (8, None)  # a windowed group and a full one (Gemma 2's alternation)


def tokens(n: int) -> list[int]:
    return list(range(100, 100 + n))


def hashes(ids: list[int]) -> list:
    out: list = []
    extend_block_hashes(out, ids, BS, ROOT)
    return out


def groups_of(table: list[int]) -> tuple[list[int], list[int]]:
    return table[0::2], table[1::2]


def test_a_table_holds_one_block_per_group_per_block_of_tokens() -> None:
    manager = BlockManager(20, BS, group_windows=WINDOWS)
    assert manager.num_groups == 2 and manager.group_windows == WINDOWS
    assert (manager.blocks_for_tokens(9), manager.full_blocks(9), manager.tokens_in(4)) == (6, 4, 8)
    added, copies = manager.allocate("r", 9)
    assert len(added) == 6 and not copies and NULL_BLOCK not in added
    assert manager.num_free_blocks == 19 - 6  # block 0 is the windowed pool's null block
    manager.check_integrity()


def test_decoding_trims_the_windowed_group_and_keeps_the_full_group() -> None:
    """To 8x the window, one token at a time: the windowed group holds at most
    ceil((W - 1) / block) + 1 = 3 blocks, the full group every block its tokens span."""
    window, context = WINDOWS[0], 64
    manager = BlockManager(40, BS, group_windows=WINDOWS)
    manager.allocate("r", 1)
    for position in range(1, context):
        manager.allocate("r", position + 1, write_from=position)
        manager.trim("r", position)
        windowed, full = groups_of(manager.table("r"))
        held = sum(1 for b in windowed if b != NULL_BLOCK)
        assert held <= -(-(window - 1) // BS) + 1
        assert NULL_BLOCK not in full and len(full) == -(-(position + 1) // BS)
        manager.check_integrity()
    windowed, full = groups_of(manager.table("r"))
    unread = manager.unread_blocks(context - 1, 0)  # 14: the last query reads 56..63
    assert windowed[:unread] == [NULL_BLOCK] * unread == [NULL_BLOCK] * 14
    assert manager.num_held("r") == context // BS + 2
    assert manager.free("r") == context // BS + 2
    assert manager.num_free_blocks == manager.num_blocks
    manager.check_integrity()


def test_a_prefix_hit_needs_the_full_groups_whole_prefix_and_the_window_of_the_rest() -> None:
    manager = BlockManager(40, BS, group_windows=WINDOWS)
    ids = tokens(24)  # 6 blocks
    block_hashes = hashes(ids)
    manager.allocate("a", 24)
    manager.cache_full_blocks("a", block_hashes, ids, 24)
    manager.trim("a", 23)  # the windowed group keeps blocks 4, 5: the rest stay cached
    manager.free("a")
    hits = manager.cached_prefix(block_hashes, ids, 23)  # at most 5 blocks: the 6th computes
    windowed, full = groups_of(hits)
    assert len(full) == 5 and NULL_BLOCK not in full
    # the query after 5 blocks (position 20) reads positions 13..20: blocks 3 and 4
    assert windowed[:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in windowed[3:]
    assert manager.tokens_in(len(hits)) == 20
    # block 5 of each group, and the free cached hits taken back (5 full, 2 windowed)
    assert manager.blocks_needed("b", 24, hits=hits) == 2 + 7
    manager.allocate("b", 24, write_from=20, hits=hits)
    assert manager.table("b")[: len(hits)] == hits
    manager.check_integrity()


def test_a_full_group_miss_ends_the_prefix_whatever_the_windowed_group_holds() -> None:
    manager = BlockManager(40, BS, group_windows=WINDOWS)
    ids = tokens(16)
    block_hashes = hashes(ids)
    manager.allocate("a", 16)
    manager.cache_full_blocks("a", block_hashes, ids, 16)
    table = manager.table("a")
    manager.free("a")
    manager.allocate("evict", 4 * (manager.num_free_blocks // 2))  # takes every free block
    assert manager.cached_prefix(block_hashes, ids, 15) == []
    manager.free("evict")
    manager.check_integrity()
    assert table  # the blocks were handed out again: their cache entries are gone


def test_a_table_for_kv_computed_elsewhere_starts_null_in_the_windowed_group_only() -> None:
    manager = BlockManager(40, BS, group_windows=WINDOWS)
    added, _ = manager.allocate("r", 24, next_position=23)
    windowed, full = groups_of(manager.table("r"))
    # the query at 23 reads positions 16..23: blocks 4 and 5
    assert manager.unread_blocks(23, 0) == 4 and manager.unread_blocks(23, 1) == 0
    assert windowed[:4] == [NULL_BLOCK] * 4 and NULL_BLOCK not in windowed[4:]
    assert NULL_BLOCK not in full and len(full) == 6
    assert manager.num_held("r") == 8 == manager.blocks_needed("s", 24, next_position=23)
    assert manager.trim("r", 23) is False  # already trimmed as made
    manager.check_integrity()


@pytest.mark.parametrize("windows", [(None, None), (8, None), (8, 8)])
def test_forks_share_every_entry_and_copy_on_write_each_group(windows) -> None:
    manager = BlockManager(40, BS, group_windows=windows)
    manager.allocate("p", 6)
    manager.fork("p", "c")
    _, copies = manager.allocate("c", 7, write_from=6)
    # tokens 6.. write logical block 1: one copy per group
    assert len(copies) == 2
    parent, child = manager.table("p"), manager.table("c")
    assert parent[:2] == child[:2] and parent[2:] != child[2:]
    manager.free("p")
    manager.free("c")
    assert manager.num_free_blocks == manager.num_blocks
    manager.check_integrity()
