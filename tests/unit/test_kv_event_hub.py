"""The scheduler's KV event hub (services/scheduler/kv_event_hub.py) over real pools: batches
numbered without gaps across pools; a late subscriber gets what is cached now (a snapshot
carrying the seq it includes) and then every later batch; one that lags loses batches (the
publisher never waits) and sees the gap; a failed worker's pool is cleared, and a rejoined
one starts from a clear and its snapshot; the tallies equal what the pools cache."""

from __future__ import annotations

import asyncio

from common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from common.prefix_hash import extend_block_hashes, root_hash
from services.scheduler.bootstrap import pool_scheduler
from services.scheduler.config import SchedulerConfig
from services.scheduler.kv_event_hub import KvEventHub, KvEventsConfig
from services.scheduler.pool import Pool
from tests.fake_worker import worker_info

BS = 4
CONFIG = SchedulerConfig(workers=("fake:1",))


def pool(worker_id: str, role: str, num_blocks: int = 16) -> Pool:
    info = worker_info(worker_id, role, num_blocks=num_blocks, block_size=BS)
    return Pool(info=info, client=None, scheduler=pool_scheduler(CONFIG, info))


def compute(p: Pool, rid: str, ids: list[int]) -> list[bytes]:
    hashes = extend_block_hashes([], ids, BS, root_hash(b"hub"))
    p.blocks.allocate(rid, len(ids))
    p.blocks.cache_full_blocks(rid, hashes, ids, len(ids))
    return hashes


def drain(subscription) -> list:
    """The batches a subscriber has now (without waiting)."""
    out = []
    while subscription._queue:
        out.append(asyncio.run(subscription.next()))
    return out


def test_batches_are_numbered_and_a_late_subscriber_starts_from_a_snapshot() -> None:
    prefill, decode = pool("p0", "prefill"), pool("d0", "decode")
    hub = KvEventHub(lambda: [prefill, decode])
    a = compute(prefill, "a", list(range(8)))
    hub.poll()  # new pools: each a clear and what it holds
    assert hub.seq == 2
    subscriber = hub.subscribe()
    snapshot = drain(subscriber)
    assert [(b.seq, b.snapshot, b.snapshot_done) for b in snapshot] == [
        (2, True, False),
        (2, True, True),
    ]
    assert snapshot[0].worker_id == "p0" and snapshot[0].role == "prefill"
    assert snapshot[0].events == (BlockStored(tuple(a), None, tuple(range(8)), BS),)
    b = compute(prefill, "b", list(range(50, 54)))
    prefill.blocks.free("a")
    compute(decode, "c", list(range(80, 84)))
    hub.poll()
    batches = drain(subscriber)
    assert [(x.seq, x.worker_id, x.snapshot) for x in batches] == [
        (3, "p0", False),
        (4, "d0", False),
    ]
    assert batches[0].events == (BlockStored((b[0],), None, (50, 51, 52, 53), BS),)
    hub.poll()  # nothing new: no batch
    assert hub.seq == 4 and drain(subscriber) == []
    held = {(w, role): dict(t.held) for (w, role), t in hub.tallies.items()}
    assert held == {("p0", "prefill"): {"GPU": 3}, ("d0", "decode"): {"GPU": 1}}
    assert prefill.blocks.pool.num_cached == 3 and decode.blocks.pool.num_cached == 1


def test_a_lagging_subscriber_loses_batches_and_sees_the_gap() -> None:
    prefill = pool("p0", "both", num_blocks=64)
    hub = KvEventHub(lambda: [prefill], config=KvEventsConfig(max_pending_batches=2))
    slow = hub.subscribe()
    for i in range(4):
        compute(prefill, f"r{i}", list(range(100 * i, 100 * i + 4)))
        hub.poll()  # the publisher never waits for `slow`
    assert slow.dropped == 2 and hub.num_dropped == 2
    seqs = [b.seq for b in drain(slow) if not b.snapshot]
    assert seqs == [2, 3]  # then 4 and 5 were lost: the next it gets shows the gap
    compute(prefill, "late", list(range(900, 904)))
    hub.poll()
    assert [b.seq for b in drain(slow)] == [6]
    hub.unsubscribe(slow)
    assert hub.num_subscribers == 0


def test_a_failed_pool_is_cleared_and_a_rejoined_one_starts_over() -> None:
    prefill = pool("p0", "prefill")
    hub = KvEventHub(lambda: [prefill])
    compute(prefill, "a", list(range(8)))
    hub.poll()
    subscriber = hub.subscribe()
    drain(subscriber)
    prefill.healthy = False
    hub.poll()
    (cleared,) = drain(subscriber)
    assert cleared.events == (AllBlocksCleared("GPU"),)
    prefill.blocks.free("a")
    prefill.blocks.allocate("x", 32)  # evictions while failed: about KV already gone
    hub.poll()
    assert drain(subscriber) == []
    late = hub.subscribe()
    assert [b.events for b in drain(late)] == [()]  # only the end of an empty snapshot
    # The worker rejoins: a fresh pool, with what it caches by the time it is polled.
    prefill.scheduler = pool_scheduler(CONFIG, prefill.info)
    prefill.healthy = True
    fresh = compute(prefill, "b", list(range(40, 44)))
    hub.poll()
    (back,) = drain(subscriber)
    assert back.events == (
        AllBlocksCleared("GPU"),
        BlockStored((fresh[0],), None, (40, 41, 42, 43), BS),
    )
    prefill.blocks.free("b")
    prefill.blocks.allocate("y", 64)
    hub.poll()
    (gone,) = drain(subscriber)
    assert gone.events == (BlockRemoved((fresh[0],)),)
    assert hub.tallies[("p0", "prefill")].held["GPU"] == 0 == prefill.blocks.pool.num_cached


def test_large_snapshots_and_deltas_are_cut_into_bounded_batches() -> None:
    prefill = pool("p0", "both", num_blocks=64)
    hub = KvEventHub(lambda: [prefill], config=KvEventsConfig(max_blocks_per_batch=3))
    hashes = compute(prefill, "a", list(range(40)))  # ten blocks in one BlockStored
    hub.poll()
    assert hub.seq == 4  # the clear and ten blocks, three blocks a batch
    subscriber = hub.subscribe()
    snapshot = drain(subscriber)
    assert len(snapshot) == 5 and snapshot[-1].snapshot_done
    stored = [e for b in snapshot for e in b.events]
    assert [h for e in stored for h in e.block_hashes] == list(hashes)
    assert [e.parent_block_hash for e in stored] == [None, hashes[2], hashes[5], hashes[8]]
