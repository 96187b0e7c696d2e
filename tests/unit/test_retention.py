"""Retention hints in the scheduler's block pools (issue 45, `kv_retention_s`): retained
free blocks are evicted after every unretained one, earliest deadline first; once their
deadline passes they are ordinary LRU blocks, in their true LRU place; a later deadline
extends, an earlier one does not. The clock is the test's."""

from __future__ import annotations

import random

import pytest

from common.retention import RetainedSet, RetentionLimits
from services.scheduler.block_pool import BlockPool

BS = 2


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def cached_pool(num_blocks: int, clock: Clock) -> BlockPool:
    """A pool whose every block is cached (key = block id) and free, freed in id order."""
    pool = BlockPool(num_blocks, clock=clock)
    blocks = pool.allocate(num_blocks)
    for block in blocks:
        pool.cache(block, ("k", block), (block,) * BS)
    pool.decref(blocks)
    return pool


def eviction_order(pool: BlockPool) -> list[int]:
    order = pool.allocate(pool.num_free)
    pool.check_integrity()
    return order


def test_retained_blocks_go_after_every_unretained_block_earliest_deadline_first():
    clock = Clock()
    pool = cached_pool(6, clock)
    pool.retain([0], clock.now + 30)
    pool.retain([1], clock.now + 10)
    pool.check_integrity()
    assert pool.num_free == 6 and pool.num_retained_free == 2
    assert pool.next_evicted_until() == 0.0
    assert eviction_order(pool) == [2, 3, 4, 5, 1, 0]


def test_an_expired_block_is_an_ordinary_lru_block_in_its_true_place():
    clock = Clock()
    pool = BlockPool(5, clock=clock)
    blocks = pool.allocate(5)
    for block in blocks:
        pool.cache(block, ("k", block), (block,) * BS)
    pool.retain([1], clock.now + 5)
    pool.decref([0, 1, 2, 3, 4])  # 1 was freed second: after 0, before 2
    clock.now += 10  # its deadline passed
    assert eviction_order(pool) == [0, 1, 2, 3, 4]


def test_a_later_deadline_extends_and_an_earlier_one_does_not():
    clock = Clock()
    pool = cached_pool(3, clock)
    assert pool.retain([0], clock.now + 10) == 1
    assert pool.retain([0], clock.now + 5) == 0  # a shorter ask changes nothing
    assert pool.retained_until(0) == clock.now + 10
    assert pool.retain([0], clock.now + 60) == 1
    clock.now += 30  # past the first deadline, within the extension
    assert eviction_order(pool) == [1, 2, 0]


def test_a_hit_on_a_retained_block_keeps_it_and_its_deadline_until_it_is_freed_again():
    clock = Clock()
    pool = cached_pool(4, clock)
    pool.retain([2], clock.now + 10)
    found = pool.lookup(("k", 2), (2,) * BS)
    pool.touch([found])  # a request without retention hits it
    assert pool.num_free == 3 and pool.num_retained_free == 0
    pool.decref([found])
    assert pool.num_retained_free == 1  # still retained (its deadline did not move)
    assert eviction_order(pool) == [0, 1, 3, 2]


def test_allocation_resets_retention_and_uncached_blocks_are_never_retained():
    clock = Clock()
    pool = BlockPool(3, clock=clock)
    (plain,) = pool.allocate(1)
    assert pool.retain([plain], clock.now + 10) == 0  # nothing cached: nothing to keep
    pool.decref([plain])
    pool = cached_pool(2, clock)
    pool.retain([0, 1], clock.now + 10)
    first, second = pool.allocate(2)  # nothing else left: the retained ones go
    assert (first, second) == (0, 1)
    assert pool.retained_until(first) == 0.0 and pool.retained_until(second) == 0.0
    pool.decref([first, second])
    assert pool.num_retained_free == 0


def test_reset_cache_puts_a_retained_free_block_first_out():
    clock = Clock()
    pool = cached_pool(3, clock)
    pool.retain([1], clock.now + 100)
    assert pool.reset_cache() == 3
    pool.check_integrity()
    assert pool.num_retained_free == 0
    assert eviction_order(pool) == [1, 0, 2]


def test_next_evicted_names_what_allocate_takes_with_its_deadline():
    clock = Clock()
    pool = cached_pool(2, clock)
    pool.retain([0], clock.now + 7)
    pool.retain([1], clock.now + 9)
    assert pool.next_evicted().key == ("k", 0)
    assert pool.next_evicted_until() == clock.now + 7
    assert pool.allocate(1) == [0]


def reference_order(free: list[tuple[int, int, float]], now: float) -> list[int]:
    """What a pool of free blocks (block, last use, deadline) evicts, by the rule itself:
    unretained (or expired) blocks by last use, then retained ones by deadline."""
    plain = sorted((use, b) for b, use, until in free if until <= now)
    kept = sorted((until, use, b) for b, use, until in free if until > now)
    return [b for _, b in plain] + [b for _, _, b in kept]


@pytest.mark.parametrize("seed", range(20))
def test_randomized_against_the_rule(seed):
    """Random frees, hits, retains and clock steps; every eviction order matches the rule
    computed from scratch, and the pool stays whole."""
    rng = random.Random(seed)
    clock = Clock()
    pool = BlockPool(12, clock=clock)
    uses: dict[int, int] = {}
    stamp = 0
    held = pool.allocate(12)
    for block in held:
        pool.cache(block, ("k", block), (block,) * BS)
    for _ in range(200):
        action = rng.random()
        if action < 0.35 and held:
            block = held.pop(rng.randrange(len(held)))
            if rng.random() < 0.4:
                pool.retain([block], clock.now + rng.choice([1, 5, 20]))
            pool.decref([block])
            stamp += 1
            uses[block] = stamp
        elif action < 0.55:
            free = [b for b in range(12) if pool.ref_count(b) == 0 and b not in held]
            if free:
                block = rng.choice(free)
                pool.touch([block])
                held.append(block)
        elif action < 0.7:
            free = [b for b in range(12) if pool.ref_count(b) == 0]
            if free:
                block = rng.choice(free)
                if pool.retain([block], clock.now + rng.choice([2, 10])):
                    stamp += 1  # retaining a free block counts as a use
                    uses[block] = stamp
        elif action < 0.85:
            clock.now += rng.choice([0.5, 3, 8])
        else:
            free = [b for b in range(12) if pool.ref_count(b) == 0]
            expected = reference_order(
                [(b, uses[b], pool.retained_until(b)) for b in free], clock.now
            )
            if expected:
                (taken,) = pool.allocate(1)
                assert taken == expected[0]
                pool.cache(taken, ("k", taken), (taken,) * BS)  # (its key again)
                held.append(taken)
        pool.check_integrity()


def test_retained_set_orders_and_expires():
    kept: RetainedSet[str] = RetainedSet()
    kept.add("a", last_use=1, deadline=50.0)
    kept.add("b", last_use=2, deadline=20.0)
    kept.add("c", last_use=3, deadline=30.0)
    assert kept.next_out(now=0.0, lru_head_use=None) == "b"  # earliest deadline
    assert kept.next_out(now=0.0, lru_head_use=7) is None  # the queue goes first
    kept.add("b", last_use=2, deadline=40.0)  # extended: its old entry is stale
    assert kept.next_out(now=35.0, lru_head_use=7) == "c"  # expired, older than the head
    assert kept.next_out(now=35.0, lru_head_use=2) is None  # the head is older
    assert kept.discard("c") and not kept.discard("c")
    assert kept.next_out(now=35.0, lru_head_use=None) == "b"
    assert len(kept) == 2 and kept.deadline("a") == 50.0


@pytest.mark.parametrize(
    "value, problem",
    [
        (float("nan"), "finite"),
        (float("inf"), "finite"),
        (-1.0, ">= 0"),
        (3600.5, "<= 3600 (--max-kv-retention-s)"),
    ],
)
def test_retention_limits_name_the_field_and_the_limit(value, problem):
    message = RetentionLimits(3600.0).problem(value)
    assert message is not None and "kv_retention_s" in message and problem in message
    assert RetentionLimits(3600.0).problem(0.0) is None
    assert RetentionLimits(3600.0).problem(3600.0) is None
    with pytest.raises(ValueError, match="max_kv_retention_s"):
        RetentionLimits(float("inf"))
