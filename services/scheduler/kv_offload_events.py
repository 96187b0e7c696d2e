"""The KV events of a pool's offload tiers (`kv_offload.py`), in vLLM's format with their
medium: `CPU` for the host tier, `Disk` for the disk tier. The scheduler's KV event hub
publishes them beside the pool's own (`GPU`), so a router sees what a scheduler holds in
every tier.

- The host tier is a block pool that records its index's events (bounded: past the
  bound, the next take is a clear and a snapshot).
- The disk tier is an index of hashes: a block written there is stored with the link
  (parent, origin) and tokens it had in the host tier; blocks a restarted worker
  reported have none, so no place in a chain: they are not published.
- The disk tier's events wait here for the hub, bounded the same way.
Pure Python.
"""

from __future__ import annotations

from collections.abc import Mapping

from common.kv_events import MEDIUM_CPU, MEDIUM_DISK, AllBlocksCleared, BlockRemoved, KvCacheEvent
from services.scheduler.block_events import BlockEvents, RopeKeyOf, no_rope_key
from services.scheduler.block_pool import LOST, BlockPool, Cached

MAX_DISK_EVENTS = 65536


class TierEvents:
    def __init__(self, block_size: int) -> None:
        self.host = BlockEvents(block_size, medium=MEDIUM_CPU)
        self.disk = BlockEvents(block_size, medium=MEDIUM_DISK)
        self._disk: list[Cached | bytes] = []  # stored entries, removed hashes, in order
        self._disk_lost = False  # untaken past MAX_DISK_EVENTS: a clear and a snapshot

    def disk_stored(self, entry: Cached) -> None:
        self._note(entry)

    def disk_removed(self, block_hash: bytes) -> None:
        self._note(block_hash)

    def _note(self, item: Cached | bytes) -> None:
        if self._disk_lost:
            return
        self._disk.append(item)
        if len(self._disk) > MAX_DISK_EVENTS:  # nobody takes them
            self._disk, self._disk_lost = [], True

    def take(
        self,
        pool: BlockPool,
        disk: Mapping[bytes, Cached | None] | None,
        rope_key_of: RopeKeyOf = no_rope_key,
    ) -> list[KvCacheEvent]:
        """The tiers' events since the last take."""
        host = pool.take_events()
        out: list[KvCacheEvent] = []
        if host and host[0] is LOST:
            out += [AllBlocksCleared(MEDIUM_CPU), *self.host.snapshot(pool.cached(), rope_key_of)]
        else:
            out += self.host.convert([e for e in host if e is not LOST], rope_key_of)
        if self._disk_lost:
            self._disk_lost = False
            entries = [e for e in (disk or {}).values() if e is not None]
            out += [AllBlocksCleared(MEDIUM_DISK), *self.disk.snapshot(entries, rope_key_of)]
        for item in self._disk:
            if isinstance(item, bytes):
                out.append(BlockRemoved((item,), MEDIUM_DISK))
            else:
                out += self.disk.convert([item], rope_key_of)
        self._disk = []
        return out

    def snapshot(
        self,
        pool: BlockPool,
        disk: Mapping[bytes, Cached | None] | None,
        rope_key_of: RopeKeyOf = no_rope_key,
    ) -> list[KvCacheEvent]:
        """What the tiers hold now, as `BlockStored` events (parents first, per tier)."""
        out = self.host.snapshot(pool.cached(), rope_key_of)
        if disk:
            out += self.disk.snapshot([e for e in disk.values() if e is not None], rope_key_of)
        return out
