"""The gateway's side of the KV events (services/gateway/kv_index.py and the router): a
scheduler's events, hashed with a salt the gateway never sees, rebuild into the gateway's
own chain (a first block from its cache salt, adapter and RoPE key); removals and clears
shrink what a scheduler holds; decode pools do not count; a stream's gaps and disorder are
caught; and the router follows the events — including where its memory of what it sent is
wrong — with the prompts it has in flight keeping a burst together, and falls back to that
memory when a scheduler's events are not followed."""

from __future__ import annotations

import pytest

from common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch
from common.prefix_hash import root_hash
from services.gateway.kv_index import EventStream, SchedulerKvIndex, StreamGap
from services.gateway.scheduler_router import (
    RouterConfig,
    SchedulerRouter,
    gateway_root,
    prompt_block_hashes,
)
from services.scheduler.block_manager import BlockManager
from services.scheduler.request import Request

BS = 4
PREFIX = list(range(200, 216))  # four full blocks


class Scheduler:
    """A scheduler's pool, with a deployment salt of its own, publishing its events."""

    def __init__(self, worker_id: str = "p0", role: str = "prefill", salt: bytes = b"secret"):
        self.blocks = BlockManager(64, BS, kv_events=True)
        self.worker_id, self.role, self.salt = worker_id, role, salt
        self.seq = 0

    def compute(self, rid: str, ids: list[int], cache_salt: str = "", lora: str = "") -> None:
        request = Request(rid, list(ids), 1, cache_salt=cache_salt, lora_name=lora)
        request.hash_root = root_hash(self.salt, cache_salt, lora)  # as Engine.submit does
        hashes = request.update_block_hashes(BS)
        self.blocks.allocate(rid, len(ids))
        self.blocks.cache_full_blocks(rid, hashes, ids, len(ids), request.chain_origin)

    def batch(self, snapshot: bool = False, done: bool = False) -> KvEventBatch:
        events = self.blocks.kv_snapshot() if snapshot else self.blocks.take_kv_events()
        if not snapshot:
            self.seq += 1
        return KvEventBatch(
            self.seq, 0.0, self.worker_id, self.role, tuple(events), snapshot, snapshot and done
        )


def ours(tokens, cache_salt="", lora=""):
    return prompt_block_hashes(tokens, BS, cache_salt, lora)


def test_events_rebuild_into_the_gateways_chain() -> None:
    scheduler, index = Scheduler(), SchedulerKvIndex(gateway_root)
    scheduler.compute("a", PREFIX + [1, 2])
    scheduler.compute("b", PREFIX[:8] + [9] * 8, cache_salt="tenant")
    scheduler.compute("c", PREFIX[:4], lora="sql")
    index.apply(scheduler.batch())
    assert index.overlap(ours(PREFIX + [5, 6, 7, 8])) == 4
    assert index.overlap(ours(PREFIX[:4] + [0] * 4)) == 1
    # Each chain under its own root: cache salt and adapter as the scheduler mixes them.
    assert index.overlap(ours(PREFIX[:8] + [9] * 8, cache_salt="tenant")) == 4
    assert index.overlap(ours(PREFIX[:8] + [9] * 8)) == 2  # (the shared first two only)
    assert index.overlap(ours(PREFIX, lora="sql")) == 1
    assert index.overlap(ours(PREFIX, cache_salt="other")) == 0
    assert index.num_blocks == 4 + 4 + 1
    # A RoPE key makes another root (a prompt the gateway hashes without one: no overlap).
    rope_first = BlockStored((b"r" * 32,), None, tuple(PREFIX[:4]), BS, rope_key="yarn:1")
    index.apply(KvEventBatch(2, 0, "p0", "prefill", (rope_first,)))
    assert index.num_blocks == 10 and index.overlap(ours(PREFIX)) == 4


def test_removals_and_clears_shrink_what_a_scheduler_holds() -> None:
    scheduler, index = Scheduler(), SchedulerKvIndex(gateway_root)
    scheduler.compute("a", PREFIX)
    index.apply(scheduler.batch())
    scheduler.blocks.free("a")
    scheduler.blocks.allocate("x", 64 * BS - 2 * BS)  # evicts the last two blocks
    index.apply(scheduler.batch())
    assert index.overlap(ours(PREFIX)) == 2
    scheduler.blocks.free("x")
    scheduler.blocks.pool.reset_cache()
    (cleared,) = scheduler.batch().events
    assert cleared == AllBlocksCleared("GPU")
    index.apply(KvEventBatch(3, 0, "p0", "prefill", (cleared,)))
    assert index.overlap(ours(PREFIX)) == 0 and index.num_blocks == 0


def test_pools_count_apart_and_decode_pools_not_at_all() -> None:
    first, second = Scheduler("p0"), Scheduler("p1")
    decode = Scheduler("d0", role="decode")
    index = SchedulerKvIndex(gateway_root)
    for pool in (first, second, decode):
        pool.compute("a", PREFIX)
        index.apply(pool.batch())
    assert index.overlap(ours(PREFIX)) == 4 and index.num_blocks == 4
    first.blocks.free("a")
    first.blocks.pool.reset_cache()
    index.apply(first.batch())
    assert index.overlap(ours(PREFIX)) == 4  # p1 still holds it
    index.apply(KvEventBatch(9, 0, "p1", "prefill", (BlockRemoved((b"?" * 32,)),)))  # unknown
    index.apply(KvEventBatch(10, 0, "p1", "prefill", (AllBlocksCleared(""),)))
    assert index.overlap(ours(PREFIX)) == 0  # the decode pool's blocks never counted


def test_a_block_whose_parent_is_unknown_is_not_placed() -> None:
    index = SchedulerKvIndex(gateway_root)
    orphan = BlockStored((b"c" * 32,), b"p" * 32, tuple(PREFIX[4:8]), BS)
    index.apply(KvEventBatch(1, 0, "p0", "both", (orphan,)))
    assert index.num_blocks == 0 and index.unchained == 1


def test_a_stream_is_a_snapshot_then_batches_without_gaps() -> None:
    scheduler = Scheduler()
    scheduler.compute("a", PREFIX)
    scheduler.batch()  # (published before this subscriber came: in its snapshot)
    stream = EventStream(SchedulerKvIndex(gateway_root))
    assert stream.feed(scheduler.batch(snapshot=True)) is False
    assert stream.index.num_blocks == 4 and not stream.synced
    assert stream.feed(scheduler.batch(snapshot=True, done=True)) is True
    assert stream.next_seq == 2
    scheduler.compute("b", list(range(900, 908)))
    assert stream.feed(scheduler.batch()) is False
    assert stream.index.num_blocks == 6
    scheduler.seq += 1  # a batch this subscriber lost
    with pytest.raises(StreamGap):
        stream.feed(scheduler.batch())
    with pytest.raises(StreamGap):  # deltas before the snapshot's end
        EventStream(SchedulerKvIndex(gateway_root)).feed(scheduler.batch())


def router_with(*schedulers: str) -> tuple[SchedulerRouter, dict[str, SchedulerKvIndex]]:
    router = SchedulerRouter(RouterConfig())
    indexes = {name: SchedulerKvIndex(gateway_root) for name in schedulers}
    for name, index in indexes.items():
        router.follow(name, index)
    return router, indexes


def test_routing_follows_the_events_where_the_memory_of_what_was_sent_is_wrong() -> None:
    router, indexes = router_with("a", "b")
    a, b = Scheduler("pa", salt=b"a"), Scheduler("pb", salt=b"b")
    prompt = ours(PREFIX + [1])
    # Sent to a (remembered), computed there... then a's cache was reset, and traffic the
    # gateway never sent left the prefix cached on b.
    first = router.choose(prompt, {"a": 0, "b": 0}, "r1")
    assert first.scheduler in ("a", "b") and first.from_events
    router.finished("r1")
    router.tracker.record("a", prompt)
    a.compute("r1", PREFIX + [1])
    indexes["a"].apply(a.batch())
    a.blocks.free("r1")
    a.blocks.pool.reset_cache()
    indexes["a"].apply(a.batch())
    b.compute("direct", PREFIX + [2])
    indexes["b"].apply(b.batch())
    assert router.tracker.overlap("a", prompt) == 4  # the old memory says a
    for rid in ("r2", "r3"):
        route = router.choose(prompt, {"a": 0, "b": 0}, rid)
        assert (route.scheduler, route.overlap_blocks) == ("b", 4)
        router.finished(rid)
    # Both streams lost: back to the memory of what was sent, wrong as it is about a.
    router.unfollow("a")
    router.unfollow("b")
    router.forget("b")  # (b went unhealthy meanwhile: what it was sent is unknown)
    assert router.overlap("a", prompt) == 4 and router.overlap("b", prompt) == 0
    route = router.choose(prompt, {"a": 0, "b": 0})
    assert (route.scheduler, route.from_events) == ("a", False)


def test_prompts_in_flight_keep_a_burst_together_until_the_events_tell() -> None:
    router, indexes = router_with("a", "b")
    prompt = ours(PREFIX)
    home = router.choose(prompt, {"a": 0, "b": 0}, "r1").scheduler
    away = "b" if home == "a" else "a"
    # Nothing is cached yet anywhere: its prompt in flight on `home` draws the burst.
    for i in range(3):
        assert router.choose(prompt, {home: 1 + i, away: 0}, f"burst{i}").scheduler == home
    for rid in ("r1", "burst0", "burst1", "burst2"):
        router.finished(rid)
    assert len(router.in_flight) == 0
    # Done, and (say) evicted at once: the events alone decide now, and say nothing.
    assert router.overlap(home, prompt) == 0
    assert router.choose(prompt, {home: 1, away: 0}).scheduler == away
    # A retry elsewhere moves the request's prompt there.
    router.choose(prompt, {home: 0}, "r9")
    router.choose(prompt, {away: 0}, "r9")
    assert router.in_flight.overlap(home, prompt) == 0
    assert router.in_flight.overlap(away, prompt) == 4
