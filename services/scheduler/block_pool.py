"""The physical blocks of one worker's paged KV pool: ref counts, the LRU free queue and the
prefix-cache index (`block_manager` keeps the tables over it).

- A block is free exactly when its ref count is 0. Free blocks wait in an O(1) LRU queue
  (`FreeBlockQueue`, a doubly linked list): allocation takes the head, a freed block joins
  the tail, and a prefix-cache hit on a free block takes it out of the middle.
- A full block whose KV is computed can be *cached*: registered in the hash index under its
  key (its chained hash, with its KV group in a hybrid pool) together with its token ids.
  It stays cached while free, and is evicted (dropped from the index) only when the free
  queue hands it out again. Every hit compares token ids, so a hash collision can never
  return the wrong KV.
- The null block (block 0, reserved in a windowed pool) is never allocated, cached, shared
  or freed.
- Events: a pool made with `record_events` lists what its index gains and loses (`Cached`,
  `Uncached`, `CLEARED` when a reset empties it) until its owner takes them
  (`take_events`); a cached block keeps the `link` its owner gave it, for a snapshot
  (`cached`). The pool never calls out. Untaken, the list stops at `max_events` (a few
  times the blocks): it is then dropped, and the next take is `[LOST]` (read the cache
  itself instead).
- Retention (issue 45, `kv_retention_s`): `retain` keeps cached blocks until a deadline.
  A retained free block waits apart (`common.retention.RetainedSet`) and is evicted only
  when no unretained free block is left, earliest deadline first; once its deadline
  passes it is an ordinary LRU block again (its place by its last use: every block
  joining the free set is stamped). A pool where nothing is retained pays a stamp per
  free and an empty-set check per allocation; retained blocks cost O(log n). Deadlines
  are wall-clock seconds from the pool's `clock`. Pure Python.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from common.retention import RetainedSet

NULL_BLOCK = 0  # in a windowed pool: the stand-in for blocks out of every query's window


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


@dataclass(frozen=True, slots=True)
class Cached:
    """A block joined the hash index under `key`, with the `link` its owner gave it."""

    key: Hashable
    token_ids: tuple[int, ...]
    link: object


@dataclass(frozen=True, slots=True)
class Uncached:
    """The block under `key` left the index (evicted or reset)."""

    key: Hashable


class Cleared:
    """A reset emptied the index."""


class Lost:
    """Events were dropped, never taken: only the index itself says what it holds."""


CLEARED = Cleared()
LOST = Lost()
PoolEvent = Cached | Uncached | Cleared | Lost


class Block:
    __slots__ = (
        "block_id", "ref_count", "block_hash", "token_ids", "link", "prev", "next",
        "retain_until", "last_use",
    )  # fmt: skip

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: Hashable | None = None
        self.token_ids: tuple[int, ...] = ()
        self.link: object = None  # the owner's, while cached
        self.prev: Block | None = None
        self.next: Block | None = None
        self.retain_until = 0.0  # wall-clock deadline while retained (0: not retained)
        self.last_use = 0  # the pool's stamp when it last became free


class FreeBlockQueue:
    """Free blocks in eviction order (head first) with O(1) append, popleft and remove."""

    def __init__(self, blocks: Iterable[Block]) -> None:
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Block]:
        node = self._head.next
        while node is not self._tail:
            yield node
            node = node.next

    def append(self, block: Block) -> None:
        last = self._tail.prev
        block.prev, block.next = last, self._tail
        last.next = self._tail.prev = block
        self._len += 1

    def popleft(self) -> Block:
        if self._len == 0:
            raise NoFreeBlocksError("no free blocks")
        block = self._head.next
        self.remove(block)
        return block

    def appendleft(self, block: Block) -> None:
        first = self._head.next
        block.prev, block.next = self._head, first
        first.prev = self._head.next = block
        self._len += 1

    def first(self) -> Block | None:
        """The block `popleft` would take (None: empty)."""
        return self._head.next if self._len else None

    def remove(self, block: Block) -> None:
        if block.prev is None or block.next is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self._len -= 1


class BlockPool:
    """Physical blocks 0..num_blocks-1: ref counts, the LRU free queue, the hash index."""

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        reserve_null: bool = False,
        record_events: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`clock`: wall-clock seconds, for retention deadlines (tests pass their own)."""
        if num_blocks <= int(reserve_null):
            raise ValueError(f"num_blocks must be more than {int(reserve_null)}, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.reserve_null = reserve_null  # block NULL_BLOCK is never handed out
        if reserve_null:
            self.blocks[NULL_BLOCK].ref_count = 1  # held for ever: never in the free queue
        self._free = FreeBlockQueue(b for b in self.blocks if b.ref_count == 0)
        self._retained: RetainedSet[int] = RetainedSet()  # retained free blocks
        self._retained_live = self._retained.live  # its truth: "any retained block?"
        self._uses = 0  # the last stamp given to a block joining the free set
        self.clock = clock
        self._cached: dict[Hashable, Block] = {}
        self.num_evictions = 0
        self._events: list[PoolEvent] | None = [] if record_events else None
        self.max_events = 8 * num_blocks + 1024

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._retained_live)

    @property
    def num_retained_free(self) -> int:
        """Free blocks retained (their deadline passed or not)."""
        return len(self._retained)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self.blocks[block_id].ref_count

    def allocate(self, count: int) -> list[int]:
        """Take `count` blocks from the head of the free queue (evicting cached ones)."""
        if count > len(self._free) and count > self.num_free:
            raise NoFreeBlocksError(f"asked for {count} blocks, {self.num_free} free")
        out = []
        retained = self._retained_live
        for _ in range(count):
            if retained:
                block = self._next_free()
                self._unfree(block)
                block.retain_until = 0.0
            else:
                block = self._free.popleft()
            if block.block_hash is not None:
                self._uncache(block)
                self.num_evictions += 1
            block.ref_count = 1
            out.append(block.block_id)
        return out

    def next_evicted(self) -> Cached | None:
        """What the next `allocate(1)` evicts from the index (None: nothing)."""
        block = self._next_free()
        if block is None or block.block_hash is None:
            return None
        return Cached(block.block_hash, block.token_ids, block.link)

    def next_evicted_until(self) -> float:
        """The retention deadline of what the next `allocate(1)` evicts (0: none)."""
        block = self._next_free()
        return 0.0 if block is None or block.block_hash is None else block.retain_until

    def _next_free(self) -> Block | None:
        """The free block the next allocation takes (None: none is free)."""
        head = self._free.first()
        if not self._retained_live:
            return head
        item = self._retained.next_out(self.clock(), None if head is None else head.last_use)
        return head if item is None else self.blocks[item]

    def _unfree(self, block: Block) -> None:
        """Take a free block out of the free set (the queue, or the retained ones)."""
        if block.prev is not None:
            self._free.remove(block)
        elif not self._retained.discard(block.block_id):
            raise ValueError(f"block {block.block_id} is not free")

    def _free_stamped(self, block: Block) -> None:
        """A block joins the free set while retention is in play, stamped with its use:
        retained while its deadline lasts, else an LRU block. (Blocks freed while nothing
        is retained keep an older stamp: every retained block joined after them.)"""
        block.last_use = self._uses = self._uses + 1
        if block.retain_until > self.clock() and block.block_hash is not None:
            self._retained.add(block.block_id, block.last_use, block.retain_until)
            return
        block.retain_until = 0.0
        self._free.append(block)

    def retain(self, block_ids: Iterable[int], until: float) -> int:
        """Keep these blocks (the cached ones) until wall-clock `until` at least: a later
        deadline extends a block's, an earlier one changes nothing; retaining a free block
        counts as a use of it (its LRU place once the deadline passes). Returns how many
        blocks' deadlines moved."""
        moved = 0
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.block_hash is None or until <= block.retain_until or self.is_null(block_id):
                continue
            block.retain_until = until
            moved += 1
            if block.ref_count == 0:  # free: retaining it is a use (its stamp is fresh)
                if block.prev is not None:
                    self._free.remove(block)
                block.last_use = self._uses = self._uses + 1
                self._retained.add(block_id, block.last_use, until)
        return moved

    def retained_until(self, block_id: int) -> float:
        """A block's retention deadline (0: none; it may have passed)."""
        return self.blocks[block_id].retain_until

    def is_null(self, block_id: int) -> bool:
        return self.reserve_null and block_id == NULL_BLOCK

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks found by `lookup` (free ones leave the queue)."""
        for block_id in block_ids:
            if self.is_null(block_id):
                continue
            block = self.blocks[block_id]
            if block.ref_count == 0:
                if block.prev is not None:
                    self._free.remove(block)
                else:
                    self._unfree(block)
            block.ref_count += 1

    def incref(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            if self.is_null(block_id):
                continue
            block = self.blocks[block_id]
            if block.ref_count == 0:
                raise ValueError(f"block {block_id} is free; cannot share it")
            block.ref_count += 1

    def decref(self, block_ids: Iterable[int]) -> None:
        """Drop references; a block reaching 0 joins the free queue's tail (still cached)."""
        for block_id in block_ids:
            if self.is_null(block_id):
                continue
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise ValueError(f"block {block_id} freed twice")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.retain_until or self._retained_live:
                    self._free_stamped(block)
                else:  # nothing retained: the queue's order alone is the LRU order
                    self._free.append(block)

    def cache(
        self, block_id: int, block_hash: Hashable, token_ids: Sequence[int], link: object = None
    ) -> bool:
        """Register a full, computed block (`link`: the owner's, kept while it is cached);
        False if caching is off or the hash is taken."""
        block = self.blocks[block_id]
        if not self.enable_caching or block.block_hash is not None or self.is_null(block_id):
            return False
        if block_hash in self._cached:
            return False  # another block already holds this prefix; this one stays private
        block.block_hash, block.token_ids, block.link = block_hash, tuple(token_ids), link
        self._cached[block_hash] = block
        if self._events is not None:
            self._record(Cached(block_hash, block.token_ids, link))
        return True

    def lookup(self, block_hash: Hashable, token_ids: Sequence[int]) -> int | None:
        """The cached block holding exactly these tokens under this hash, if any."""
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block.block_id

    def _uncache(self, block: Block, record: bool = True) -> None:
        del self._cached[block.block_hash]
        if record and self._events is not None:
            self._record(Uncached(block.block_hash))
        block.block_hash, block.token_ids, block.link = None, (), None

    def reset_cache(self) -> int:
        """Forget every cached block that is free (e.g. the worker lost its KV): one
        `CLEARED` event when that empties the index, an `Uncached` per block otherwise."""
        dropped = [b for b in self._cached.values() if b.ref_count == 0]
        everything = len(dropped) == len(self._cached)
        for block in dropped:
            self._uncache(block, record=not everything)
            if self._retained.discard(block.block_id):  # nothing left to keep: out first
                block.retain_until, block.last_use = 0.0, 0
                self._free.appendleft(block)
        if everything and self._events is not None:
            self._record(CLEARED)
        return len(dropped)

    @property
    def records_events(self) -> bool:
        return self._events is not None

    def _record(self, event: PoolEvent) -> None:
        events = self._events
        if events and events[0] is LOST:
            return
        events.append(event)
        if len(events) > self.max_events:  # nobody takes them
            events[:] = [LOST]

    def take_events(self) -> list[PoolEvent]:
        """The events since the last take, oldest first (none unless `record_events`)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    def cached(self) -> Iterator[Cached]:
        """Every cached block now, as the `Cached` event that would announce it."""
        for key, block in self._cached.items():
            yield Cached(key, block.token_ids, block.link)

    def check_integrity(self) -> None:
        """Raise AssertionError unless queue, ref counts and hash index agree exactly."""
        queued = list(self._free)
        if len(queued) != len(self._free) or len({b.block_id for b in queued}) != len(queued):
            raise AssertionError("free queue is corrupt (length or duplicates)")
        in_queue = {b.block_id for b in queued}
        retained = set(self._retained)
        if retained & in_queue:
            raise AssertionError(f"blocks {sorted(retained & in_queue)} are free twice")
        if any(self.blocks[b].block_hash is None for b in retained):
            raise AssertionError("a retained free block holds nothing cached")
        in_queue |= retained
        for block in self.blocks:
            if block.ref_count < 0:
                raise AssertionError(f"block {block.block_id} has ref count {block.ref_count}")
            if (block.ref_count == 0) != (block.block_id in in_queue):
                raise AssertionError(
                    f"block {block.block_id}: ref count {block.ref_count} but "
                    f"{'in' if block.block_id in in_queue else 'not in'} the free queue"
                )
            if block.block_hash is not None and self._cached.get(block.block_hash) is not block:
                raise AssertionError(f"block {block.block_id} has a hash the index lacks")
        for block_hash, block in self._cached.items():
            if block.block_hash != block_hash or not block.token_ids:
                raise AssertionError(f"hash index entry for block {block.block_id} is stale")
