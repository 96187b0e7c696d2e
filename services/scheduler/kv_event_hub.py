"""The scheduler's KV events: taken from every pool's block manager, numbered, and handed to
each subscriber of the `KvEvents` stream, and tallied for the metrics. No grpc here.

- `poll()` (every `interval_s`, and before a snapshot) takes each pool's events and
  publishes them as one batch per pool (cut at `max_blocks_per_batch`), numbered 1, 2, 3...
  across pools. The block managers only collect: nothing calls out of the step loop.
- A pool whose worker failed publishes `AllBlocksCleared` (its KV is gone) and nothing more
  until it serves again; then, as after a rejoin (a fresh block manager), a clear and what
  it holds.
- `subscribe()` polls, then gives the new subscriber a snapshot of every serving pool (its
  cached blocks as `BlockStored`, carrying the seq of the last batch they include) followed
  by every later batch. A subscriber holds at most `max_pending_batches` unread batches past
  its snapshot; the ones after that are dropped for it (the step loop never waits), and the
  gap in seq tells it to subscribe again.
- Metrics (`tallies`): per pool and medium, events by kind, blocks stored and removed, and
  blocks held (stored less removed, zero after a clear: equal to what the pool caches).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from common.kv_events import (
    MEDIUM_GPU,
    MEDIUMS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvCacheEvent,
    KvEventBatch,
    chunk_events,
)
from common.log import get_logger
from services.scheduler.block_events import RopeKeyOf, no_rope_key
from services.scheduler.block_manager import BlockManager
from services.scheduler.pool import Pool

log = get_logger(__name__)


@dataclass(frozen=True)
class KvEventsConfig:
    """How often pools are polled, how far a subscriber may lag (in batches past its
    snapshot) before batches are dropped for it, and the most blocks in one batch."""

    interval_s: float = 0.02
    max_pending_batches: int = 512
    max_blocks_per_batch: int = 1024

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s}")
        if self.max_pending_batches < 1 or self.max_blocks_per_batch < 1:
            raise ValueError("max_pending_batches and max_blocks_per_batch must be >= 1")


class Subscription:
    """One subscriber's batches: its snapshot, then the deltas, unless it lags."""

    def __init__(self, snapshot: list[KvEventBatch], max_pending: int) -> None:
        self._queue: deque[KvEventBatch] = deque(snapshot)
        self._snapshot_left = len(snapshot)
        self._max_pending = max_pending
        self._ready = asyncio.Event()
        self._ready.set()
        self.dropped = 0
        self.closed = False

    def offer(self, batch: KvEventBatch) -> bool:
        """Queue a delta batch; False (dropped: the subscriber will see the gap) when it
        already has `max_pending` unread ones."""
        if len(self._queue) - self._snapshot_left >= self._max_pending:
            self.dropped += 1
            return False
        self._queue.append(batch)
        self._ready.set()
        return True

    async def next(self) -> KvEventBatch:
        while not self._queue:
            self._ready.clear()
            await self._ready.wait()
        if self._snapshot_left:
            self._snapshot_left -= 1
        return self._queue.popleft()


@dataclass
class PoolTally:
    """One pool's published events, per medium (the metrics)."""

    events: Counter = field(default_factory=Counter)  # (medium, kind) -> events
    stored: Counter = field(default_factory=Counter)  # medium -> blocks
    removed: Counter = field(default_factory=Counter)
    held: Counter = field(default_factory=Counter)

    def count(self, event: KvCacheEvent) -> None:
        self.events[(event.medium, type(event).__name__)] += 1
        if isinstance(event, BlockStored):
            self.stored[event.medium] += len(event.block_hashes)
            self.held[event.medium] += len(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            self.removed[event.medium] += len(event.block_hashes)
            self.held[event.medium] -= len(event.block_hashes)
        elif event.medium:
            self.held[event.medium] = 0
        else:
            self.held.clear()


@dataclass
class _Track:
    blocks: BlockManager
    live: bool = False  # its events go out (its worker serves)


class KvEventHub:
    def __init__(
        self,
        pools: Callable[[], Sequence[Pool]],
        rope_key_of: RopeKeyOf = no_rope_key,
        config: KvEventsConfig | None = None,
    ) -> None:
        self._pools = pools
        self._rope_key_of = rope_key_of
        self.config = config or KvEventsConfig()
        self.seq = 0
        self._tracks: dict[Pool, _Track] = {}
        self._subscribers: set[Subscription] = set()
        self.tallies: dict[tuple[str, str], PoolTally] = {}  # (worker_id, role) -> tally
        self.num_dropped = 0  # batches dropped for lagging subscribers

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    async def run(self) -> None:
        """Poll until cancelled; a failed poll is logged and the next one goes on."""
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                self.poll()
            except Exception:
                log.exception("kv_events_poll_failed")

    def poll(self) -> None:
        """Publish every pool's events since the last poll."""
        now = time.time()
        for pool in self._pools():
            events = self._take(pool)
            for chunk in chunk_events(events, self.config.max_blocks_per_batch):
                self._publish(pool, chunk, now)

    def _take(self, pool: Pool) -> list[KvCacheEvent]:
        track = self._tracks.get(pool)
        blocks = pool.blocks
        fresh = track is None or track.blocks is not blocks  # new, or its worker rejoined
        if track is None:
            track = self._tracks[pool] = _Track(blocks)
        track.blocks = blocks
        tiers = pool.scheduler.offload  # its offload tiers (CPU, Disk), if any
        if not pool.healthy:
            blocks.take_kv_events()  # about KV that is gone with the worker
            if tiers is not None:
                tiers.take_kv_events()
            if track.live:
                track.live = False
                return [AllBlocksCleared(m) for m in self._mediums(pool)]
            return []
        if fresh or not track.live:
            blocks.take_kv_events()  # the snapshot says it all
            if tiers is not None:
                tiers.take_kv_events()
            track.live = True
            return [
                *(AllBlocksCleared(m) for m in self._mediums(pool)),
                *self._snapshot(pool, blocks),
            ]
        events = blocks.take_kv_events(self._rope_key_of)
        return events if tiers is None else events + tiers.take_kv_events(self._rope_key_of)

    @staticmethod
    def _mediums(pool: Pool) -> list[str]:
        tiers = pool.scheduler.offload
        return [MEDIUM_GPU] if tiers is None else list(MEDIUMS)

    def _snapshot(self, pool: Pool, blocks) -> list[KvCacheEvent]:
        """What the pool holds now in every medium, as `BlockStored` events."""
        events = blocks.kv_snapshot(self._rope_key_of)
        tiers = pool.scheduler.offload
        return events if tiers is None else events + tiers.kv_snapshot(self._rope_key_of)

    def _publish(self, pool: Pool, events: list[KvCacheEvent], now: float) -> None:
        self.seq += 1
        batch = KvEventBatch(self.seq, now, pool.info.worker_id, pool.info.role, tuple(events))
        tally = self.tallies.setdefault((pool.info.worker_id, pool.info.role), PoolTally())
        for event in events:
            tally.count(event)
        for subscriber in self._subscribers:
            if not subscriber.offer(batch):
                self.num_dropped += 1

    def subscribe(self) -> Subscription:
        """A new subscriber: the snapshot of every serving pool, then every later batch."""
        self.poll()
        now = time.time()
        batches = []
        for pool, track in self._tracks.items():
            if not track.live:
                continue
            snapshot = self._snapshot(pool, track.blocks)
            for chunk in chunk_events(snapshot, self.config.max_blocks_per_batch):
                batches.append(
                    KvEventBatch(
                        self.seq, now, pool.info.worker_id, pool.info.role, tuple(chunk), True
                    )
                )
        done = KvEventBatch(self.seq, now, "", "", (), snapshot=True, snapshot_done=True)
        subscription = Subscription([*batches, done], self.config.max_pending_batches)
        self._subscribers.add(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        subscription.closed = True
        self._subscribers.discard(subscription)
