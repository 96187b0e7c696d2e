"""What a scheduler's prefix caches hold, as its KV events say, in the gateway's own block
hashes (pure: no grpc). The router asks it how much of a prompt a scheduler holds.

- The events name blocks by the scheduler's hashes, salted per deployment: the gateway
  cannot compute them, so it rebuilds its own chain as Dynamo's router does. A stored block
  is hashed from its parent's gateway hash and its tokens; a sequence's first block (no
  parent) from the gateway's root of the extensions it carries (cache salt, adapter, RoPE
  key). Per pool and medium it keeps scheduler hash -> gateway hash while the block is
  cached; a stored block whose parent it does not know (the parent was evicted before) has
  no place in a chain and is counted in `unchained`, not kept.
- Only pools that run prompts count (a decode pool's cache spares a transfer, not compute).
- `overlap` counts the prompt's leading blocks cached in any of its pools, in any medium.
- `EventStream` holds a stream's order rules: a snapshot first (applied to a fresh index,
  used only once complete), then batches numbered one after the other. A gap, a delta
  before the snapshot's end or a malformed message raises `StreamGap`: the caller falls
  back and subscribes again.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch
from common.prefix_hash import BlockHash, block_hash

RootOf = Callable[[str, str, str], BlockHash]  # (cache_salt, lora_name, rope_key) -> root


class StreamGap(Exception):
    """The stream can no longer be trusted (a lost batch, or out of order)."""


class SchedulerKvIndex:
    """One scheduler's cached prompt blocks, as gateway hashes."""

    def __init__(self, root_of: RootOf) -> None:
        self._root_of = root_of
        # worker_id -> medium -> the scheduler's hash -> the gateway's.
        self._pools: dict[str, dict[str, dict[BlockHash, BlockHash]]] = {}
        self._held: Counter[BlockHash] = Counter()  # gateway hash -> entries holding it
        self.unchained = 0

    @property
    def num_blocks(self) -> int:
        """Distinct blocks (gateway hashes) held."""
        return len(self._held)

    def holds(self, gateway_hash: BlockHash) -> bool:
        return gateway_hash in self._held

    def overlap(self, hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of `hashes` held (the first miss ends the shared prefix)."""
        count = 0
        for h in hashes:
            if h not in self._held:
                break
            count += 1
        return count

    def apply(self, batch: KvEventBatch) -> None:
        if not batch.runs_prompts:
            return
        pool = self._pools.setdefault(batch.worker_id, {})
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._store(pool, event)
            elif isinstance(event, BlockRemoved):
                blocks = pool.get(event.medium, {})
                for h in event.block_hashes:
                    self._drop(blocks.pop(h, None))
            elif isinstance(event, AllBlocksCleared):
                for medium in [event.medium] if event.medium else list(pool):
                    for gateway_hash in pool.pop(medium, {}).values():
                        self._drop(gateway_hash)

    def _store(self, pool: dict[str, dict[BlockHash, BlockHash]], event: BlockStored) -> None:
        if event.parent_block_hash is None:
            parent = self._root_of(event.cache_salt, event.lora_name, event.rope_key)
        else:
            parent = next(
                (b[event.parent_block_hash] for b in pool.values() if event.parent_block_hash in b),
                None,
            )
            if parent is None:
                self.unchained += len(event.block_hashes)
                return
        blocks = pool.setdefault(event.medium, {})
        for i, scheduler_hash in enumerate(event.block_hashes):
            parent = block_hash(parent, event.block_tokens(i))
            if scheduler_hash not in blocks:
                blocks[scheduler_hash] = parent
                self._held[parent] += 1

    def _drop(self, gateway_hash: BlockHash | None) -> None:
        if gateway_hash is None:
            return
        self._held[gateway_hash] -= 1
        if self._held[gateway_hash] <= 0:
            del self._held[gateway_hash]


class EventStream:
    """One subscription's order rules over a fresh index (module docstring)."""

    def __init__(self, index: SchedulerKvIndex) -> None:
        self.index = index
        self.synced = False  # the snapshot is complete: the index may be used
        self.next_seq: int | None = None

    def feed(self, batch: KvEventBatch) -> bool:
        """Apply one batch; True when it completes the snapshot (the index is now usable).
        Raises StreamGap when the stream broke its rules."""
        if not self.synced:
            if not batch.snapshot:
                raise StreamGap(f"batch {batch.seq} came before the snapshot's end")
            self.index.apply(batch)
            if batch.snapshot_done:
                self.synced = True
                self.next_seq = batch.seq + 1
            return self.synced
        if batch.snapshot or batch.seq != self.next_seq:
            raise StreamGap(f"expected batch {self.next_seq}, got {batch.seq}")
        self.index.apply(batch)
        self.next_seq = batch.seq + 1
        return False
