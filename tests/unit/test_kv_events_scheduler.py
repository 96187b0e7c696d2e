"""KV events on the scheduler's side (issue 45, item 3): what a block manager's prefix cache
reports in vLLM's format — a run of cached blocks as one `BlockStored` naming its parent
(none for a sequence's first block, which carries the request's cache salt, adapter and
RoPE key instead), evictions as `BlockRemoved`, a reset as `AllBlocksCleared` — one group
speaking for a hybrid pool; a snapshot that lists what is cached, parents first; events
replayed after a randomized run equal the pool's contents; the shapes survive protobuf and
are cut into bounded batches."""

from __future__ import annotations

import random

import pytest

from common.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventBatch,
    chunk_events,
    merge_events,
)
from common.kv_events_pb import batch_from_pb, batch_to_pb
from common.prefix_hash import ChainOrigin, extend_block_hashes, root_hash
from services.scheduler.block_manager import BlockManager
from services.scheduler.request import Request

BS = 4


def chain(ids: list[int], origin: ChainOrigin | None = None, salt: bytes = b"s") -> list[bytes]:
    origin = origin or ChainOrigin()
    root = root_hash(salt, origin.cache_salt, origin.lora_name)
    return extend_block_hashes([], ids, BS, root)


def run(manager: BlockManager, rid: str, ids: list[int], origin=None) -> list[bytes]:
    """A request computes `ids` whole (its full blocks cached) and keeps its blocks."""
    hashes = chain(ids, origin)
    manager.allocate(rid, len(ids))
    manager.cache_full_blocks(rid, hashes, ids, len(ids), origin)
    return hashes


def cached_hashes(manager: BlockManager) -> set[bytes]:
    """The published group's hashes the pool caches now."""
    return {h for c in manager.pool.cached() if (h := manager.events.hash_of(c.key)) is not None}


def replay(events, held: set[bytes] | None = None) -> set[bytes]:
    held = set() if held is None else held
    for event in events:
        if isinstance(event, BlockStored):
            held.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            held.difference_update(event.block_hashes)
        else:
            held.clear()
    return held


def test_a_computed_prompt_is_one_block_stored_whose_first_block_names_its_root() -> None:
    manager = BlockManager(16, BS, kv_events=True)
    ids = list(range(10, 20))  # two full blocks and a partial one
    origin = ChainOrigin(cache_salt="tenant", lora_name="sql", num_prompt_tokens=10)
    hashes = run(manager, "r", ids, origin)
    (event,) = manager.take_kv_events(lambda n: f"rope{n}")
    assert event == BlockStored(
        block_hashes=tuple(hashes[:2]),
        parent_block_hash=None,
        token_ids=tuple(ids[:8]),
        block_size=BS,
        lora_name="sql",
        medium=MEDIUM_GPU,
        cache_salt="tenant",
        rope_key="rope10",
    )
    assert manager.take_kv_events() == []  # taken once
    # The next block, once computed, continues the chain: its parent, no root fields.
    ids += [20, 21]
    hashes = extend_block_hashes(hashes, ids, BS, b"")  # (the root is only for block 0)
    manager.allocate("r", len(ids))
    manager.cache_full_blocks("r", hashes, ids, len(ids), origin)
    (event,) = manager.take_kv_events()
    assert (event.parent_block_hash, event.block_hashes) == (hashes[1], (hashes[2],))
    assert (event.lora_name, event.cache_salt, event.rope_key) == ("sql", "", "")


def test_a_request_names_its_origin() -> None:
    request = Request("r", list(range(9)), 4, cache_salt="c", lora_name="a")
    assert request.chain_origin == ChainOrigin("c", "a", 9)


def test_evictions_are_block_removed_and_hits_say_nothing() -> None:
    manager = BlockManager(4, BS, kv_events=True)
    a = run(manager, "a", list(range(8)))
    manager.free("a")
    manager.take_kv_events()
    hits = manager.cached_prefix(a, list(range(8)), 7)
    manager.allocate("again", 8, hits=hits)  # a hit takes no event
    assert manager.take_kv_events() == []
    manager.free("again")
    manager.allocate("b", 16)  # every block: both cached ones go (the tail first)
    assert manager.take_kv_events() == [BlockRemoved((a[1], a[0]), MEDIUM_GPU)]
    assert cached_hashes(manager) == set()


def test_a_reset_that_empties_the_cache_is_all_blocks_cleared() -> None:
    manager = BlockManager(8, BS, kv_events=True)
    a = run(manager, "a", list(range(8)))
    b = run(manager, "b", list(range(50, 58)))
    manager.free("a")
    manager.take_kv_events()
    # b still holds its blocks: only a's go, one by one.
    assert manager.pool.reset_cache() == 2
    assert replay(manager.take_kv_events(), set(a) | set(b)) == set(b)
    manager.free("b")
    assert manager.pool.reset_cache() == 2
    assert manager.take_kv_events() == [AllBlocksCleared(MEDIUM_GPU)]
    assert manager.pool.num_cached == 0


def test_no_events_are_kept_unless_asked_for() -> None:
    manager = BlockManager(8, BS)
    run(manager, "a", list(range(8)))
    assert manager.take_kv_events() == [] and manager.pool.take_events() == []
    assert manager.kv_snapshot() == []  # unlinked blocks have no place in a chain


def test_a_hybrid_pool_publishes_its_full_attention_group() -> None:
    manager = BlockManager(30, BS, group_windows=(8, None, 8), kv_events=True)
    assert manager.events.group == 1
    ids = list(range(16))
    hashes = run(manager, "r", ids)
    (event,) = manager.take_kv_events()
    assert event.block_hashes == tuple(hashes) and event.token_ids == tuple(ids)
    assert manager.pool.num_cached == 12  # every group cached; one speaks
    assert manager.kv_snapshot() == [event]
    manager.trim("r", 15)  # the windowed groups' first blocks are freed: no event
    assert manager.take_kv_events() == []
    all_windowed = BlockManager(30, BS, group_windows=(8, 8), kv_events=True)
    assert all_windowed.events.group == 0


def test_the_snapshot_lists_parents_before_children() -> None:
    manager = BlockManager(10, BS, kv_events=True)
    ids = list(range(12))
    hashes = chain(ids)
    run(manager, "a", ids[:8])  # caches blocks 0 and 1
    manager.allocate("b", 12)  # the same prompt computed apart: its blocks 0, 1 stay
    manager.cache_full_blocks("b", hashes, ids, 12)  # private, its block 2 is cached
    manager.free("a")
    manager.allocate("x", 28)  # evicts a's blocks 0 and 1
    manager.free("x")
    run(manager, "c", ids[:8])  # blocks 0 and 1 come back, after their child
    assert [manager.events.hash_of(c.key) for c in manager.pool.cached()] == [
        hashes[2],
        hashes[0],
        hashes[1],
    ]
    assert manager.kv_snapshot() == [
        BlockStored(tuple(hashes), None, tuple(ids), BS, "", MEDIUM_GPU)
    ]  # one run, in chain order


def test_events_replayed_after_a_randomized_run_equal_the_pool_contents() -> None:
    rng = random.Random(45)
    for windows in ((None,), (8, None)):
        manager = BlockManager(40, BS, group_windows=windows, kv_events=True)
        held: set[bytes] = set()
        running: dict[str, tuple[list[int], list[bytes]]] = {}
        prefixes = [[rng.randrange(1000) for _ in range(12)] for _ in range(4)]
        for step in range(400):
            op = rng.random()
            if op < 0.45 and len(running) < 6:
                ids = rng.choice(prefixes)[: rng.randrange(4, 13)] + [
                    rng.randrange(1000) for _ in range(rng.randrange(0, 9))
                ]
                rid = f"r{step}"
                hashes = chain(ids)
                hits = manager.cached_prefix(hashes, ids, len(ids) - 1)
                if not manager.can_allocate(rid, len(ids), hits=hits):
                    continue
                manager.allocate(rid, len(ids), hits=hits)
                computed = rng.randrange(manager.tokens_in(len(hits)), len(ids) + 1)
                manager.cache_full_blocks(rid, hashes, ids, computed)
                running[rid] = (ids, hashes)
            elif op < 0.85 and running:
                rid = rng.choice(sorted(running))
                manager.free(rid)
                del running[rid]
            elif op < 0.9:
                manager.pool.reset_cache()
            if rng.random() < 0.3:
                replay(manager.take_kv_events(), held)
            manager.check_integrity()
        replay(manager.take_kv_events(), held)
        assert held == cached_hashes(manager), windows
        assert replay(manager.kv_snapshot()) == held
        snapshot_order: set[bytes] = set()
        for event in manager.kv_snapshot():  # parents first, where they are cached
            if event.parent_block_hash in held:
                assert event.parent_block_hash in snapshot_order
            snapshot_order.update(event.block_hashes)


def test_runs_merge_and_big_events_are_cut_into_bounded_batches() -> None:
    h = [bytes([i]) * 32 for i in range(10)]
    stored = [
        BlockStored((h[0],), None, (0, 1), 2, "", MEDIUM_GPU, "salt"),
        BlockStored((h[1],), h[0], (2, 3), 2),
        BlockStored((h[2],), h[1], (4, 5), 2),
        BlockStored((h[3],), h[9], (6, 7), 2),  # another sequence
        BlockRemoved((h[4],)),
        BlockRemoved((h[5],)),
    ]
    merged = merge_events(stored)
    assert merged == [
        BlockStored(tuple(h[:3]), None, tuple(range(6)), 2, "", MEDIUM_GPU, "salt"),
        stored[3],
        BlockRemoved((h[4], h[5])),
    ]
    chunks = chunk_events(merged, 2)
    assert [sum(len(e.block_hashes) for e in c) for c in chunks] == [2, 2, 2]
    first, second = chunks[0][0], chunks[1][0]
    assert first == BlockStored(tuple(h[:2]), None, (0, 1, 2, 3), 2, "", MEDIUM_GPU, "salt")
    assert second == BlockStored((h[2],), h[1], (4, 5), 2)  # no root fields past block 0
    assert replay(e for c in chunks for e in c) == replay(merged)
    with pytest.raises(ValueError):
        BlockStored((h[0],), None, (1, 2, 3), 2)  # tokens must fill the blocks


def test_batches_survive_protobuf() -> None:
    h = [bytes([i]) * 32 for i in range(3)]
    batch = KvEventBatch(
        seq=7,
        ts=1.5,
        worker_id="w0",
        role="prefill",
        events=(
            BlockStored((h[0], h[1]), None, (1, 2, 3, 4), 2, "sql", MEDIUM_GPU, "c", "r"),
            BlockStored((h[2],), h[1], (5, 6), 2, "sql"),
            BlockRemoved((h[0],)),
            AllBlocksCleared(""),
        ),
        snapshot=True,
        snapshot_done=True,
    )
    assert batch_from_pb(batch_to_pb(batch)) == batch
    assert batch.runs_prompts and not KvEventBatch(1, 0, "d", "decode", ()).runs_prompts


def test_events_nobody_takes_are_dropped_and_the_next_take_reads_the_cache() -> None:
    manager = BlockManager(8, BS, kv_events=True)
    manager.pool.max_events = 5
    kept = []
    for i in range(6):
        kept.append(run(manager, f"r{i}", list(range(10 * i, 10 * i + 4)))[0])
        if i < 5:
            manager.free(f"r{i}")
    manager.allocate("x", 4 * 3)  # evictions beyond the bound are not kept either
    assert len(manager.pool._events) == 1
    events = manager.take_kv_events()
    assert events[0] == AllBlocksCleared(MEDIUM_GPU)
    held = replay(events)
    assert held == cached_hashes(manager) and kept[5] in held
    y = run(manager, "y", list(range(90, 94)))  # recording again
    assert y[0] in replay(manager.take_kv_events(), held) == cached_hashes(manager)
