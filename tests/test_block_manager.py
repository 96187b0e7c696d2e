"""Block pool and block tables: ref counts, free list, integrity checks."""

import pytest

from services.scheduler.block_manager import BlockManager, BlockPool, NoFreeBlocksError


def test_allocate_and_free_return_blocks_in_fifo_order():
    pool = BlockPool(4)
    first = pool.allocate(3)
    assert first == [0, 1, 2]
    assert pool.num_free == 1
    pool.decref([1])
    pool.decref([0, 2])
    assert pool.num_free == 4
    # Freed blocks go to the back of the queue: the never-used block 3 comes first.
    assert pool.allocate(4) == [3, 1, 0, 2]
    pool.check_integrity()


def test_allocating_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(2)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(3)
    assert pool.num_free == 2


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
    assert bm.allocate("a", 5) == [0, 1]
    assert bm.allocate("a", 8) == []  # still fits in two blocks
    assert bm.allocate("a", 9) == [2]
    assert bm.table("a") == [0, 1, 2]
    assert bm.num_missing_blocks("a", 16) == 1
    assert bm.can_allocate("b", 20) is True
    assert bm.can_allocate("b", 21) is False
    assert bm.can_allocate("b", 16, reserve=1) is True
    assert bm.can_allocate("b", 17, reserve=1) is False
    bm.check_integrity()
    assert bm.free("a") == 3
    assert bm.num_free_blocks == 8
    assert bm.free("a") == 0
    bm.check_integrity()


def test_integrity_check_catches_a_corrupted_table():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("a", 8)
    bm._tables["a"].append(3)  # a block the pool thinks is free
    with pytest.raises(AssertionError, match="block 3"):
        bm.check_integrity()


def test_invalid_geometry_is_a_value_error():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks=0, block_size=16)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(num_blocks=4, block_size=0)
