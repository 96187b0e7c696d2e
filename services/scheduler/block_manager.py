"""Block tables for one worker's paged KV pool: per-request tables over a `BlockPool`, the
prefix cache, copy-on-write and sliding-window trimming.

The scheduler owns which physical block holds what; the worker only stores bytes.

- KV groups (`common.kv_groups`): a model whose layers all attend alike has one group, and
  a table entry is a block of every layer. A model mixing windowed and full layers has
  several groups (vLLM's hybrid KV cache manager): each group has its own block per
  `block_size` tokens, all kept in one flat table, interleaved: entry
  `i * num_groups + g` is group g's block for the i-th `block_size` tokens (a *logical*
  block). Everything here that counts "blocks" of a table counts entries.
- Prefix caching: a full, computed block is offered to the pool's cache under its chained
  hash (see `prefix_hash`), and group g's under (hash, g) in a hybrid pool.
- KV events (`kv_events=True`): what the cache gains and loses, in vLLM's format, for its
  owner to take (`take_kv_events`) and publish; `kv_snapshot` is what it holds now
  (`block_events.py`: which group speaks for a hybrid pool, and how).
- Copy-on-write: before a request writes into a block it shares (ref count > 1, e.g. after
  `fork` for parallel sampling), the block is replaced by a fresh copy; the copies to make
  are returned for the worker to run before the step.
- Sliding windows: a group whose layers attend through a window of W tokens has a query at
  position p read only keys p - W < k <= p, so its block whose last position is before
  (next query - W + 1) is never read again. `trim` swaps such blocks in a table for the
  *null block* (block 0, reserved in a windowed pool: never allocated, never written,
  zeros on the worker) and frees them, and a table made for KV that is already computed
  (a transfer's or a swap-in's destination) holds the null block there from the start.
  The windowed groups then hold about (W + one block) / context of the blocks full
  attention needs; full groups keep every block. The null block is never cached, copied,
  shared, freed or moved: transfers and swaps skip its pairs (`is_null`).

Predicate/action pairs (`can_allocate` / `allocate`) keep the policy readable. Pure Python.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence

from common.kv_events import AllBlocksCleared, KvCacheEvent
from common.prefix_hash import BlockHash, ChainOrigin
from services.scheduler.block_events import (
    BlockEvents,
    BlockLink,
    RopeKeyOf,
    event_group,
    no_rope_key,
)
from services.scheduler.block_pool import LOST, NULL_BLOCK, BlockPool, NoFreeBlocksError

__all__ = ["NULL_BLOCK", "BlockManager", "BlockPool", "NoFreeBlocksError"]


class BlockManager:
    """Per-request block tables over one BlockPool, with prefix caching and copy-on-write.
    `group_windows`: each KV group's sliding window in tokens (None: full attention); one
    group by default. `window` is the one-group shorthand (`group_windows=(window,)`)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        window: int | None = None,
        group_windows: Sequence[int | None] | None = None,
        kv_events: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        windows = tuple(group_windows) if group_windows is not None else (window,)
        if not windows or any(w is not None and w <= 0 for w in windows):
            raise ValueError(f"windows must be positive or None, got {windows}")
        self.block_size = block_size
        self.group_windows = windows
        self.num_groups = len(windows)
        windowed = any(w is not None for w in windows)
        self.pool = BlockPool(
            num_blocks, enable_caching, reserve_null=windowed, record_events=kv_events, clock=clock
        )
        self.events = BlockEvents(block_size, self.num_groups, event_group(windows))
        self._tables: dict[str, list[int]] = {}
        # Leading logical blocks of each table already offered to the cache.
        self._num_cached: dict[str, int] = {}
        # Per group, leading logical blocks of each table already trimmed (windowed groups).
        self._trimmed: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        """Blocks requests can hold (the null block of a windowed pool is not one)."""
        return self.pool.num_blocks - int(self.pool.reserve_null)

    def is_null(self, block_id: int) -> bool:
        """Whether a table entry is the null block (no KV: skip it when moving blocks)."""
        return self.pool.is_null(block_id)

    def num_held(self, request_id: str) -> int:
        """Blocks the request holds (its table less the null entries)."""
        return sum(1 for b in self._tables.get(request_id, ()) if not self.is_null(b))

    def unread_blocks(self, next_position: int, group: int = 0) -> int:
        """Leading logical blocks of `group` that no query at `next_position` or later reads
        (0 for a full-attention group)."""
        window = self.group_windows[group]
        if window is None:
            return 0
        return max(0, (next_position - window + 1) // self.block_size)

    def trim(self, request_id: str, next_position: int) -> bool:
        """Free the request's blocks that no query from `next_position` on reads, putting the
        null block in their place; whether the table changed (never without a window: this
        runs for every request scheduled)."""
        if not self.pool.reserve_null:
            return False
        table = self._tables.get(request_id)
        if table is None:
            return False
        n, trimmed = self.num_groups, self._trimmed[request_id]
        dropped: list[int] = []
        for group in range(n):
            end = min(self.unread_blocks(next_position, group), len(table) // n)
            for index in range(trimmed[group] * n + group, end * n, n):
                if not self.is_null(table[index]):
                    dropped.append(table[index])
                table[index] = NULL_BLOCK
            trimmed[group] = max(trimmed[group], end)
        self.pool.decref(reversed(dropped))
        return bool(dropped)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_requests(self) -> int:
        return len(self._tables)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Table entries that hold `num_tokens` tokens (one per group per block of tokens)."""
        return -(-num_tokens // self.block_size) * self.num_groups

    def full_blocks(self, num_tokens: int) -> int:
        """Table entries whose blocks `num_tokens` tokens fill."""
        return num_tokens // self.block_size * self.num_groups

    def tokens_in(self, num_entries: int) -> int:
        """Tokens the first `num_entries` entries of a table hold (a prefix hit's length)."""
        return num_entries // self.num_groups * self.block_size

    def table(self, request_id: str) -> list[int]:
        return list(self._tables.get(request_id, ()))

    def has(self, request_id: str) -> bool:
        return request_id in self._tables

    def _key(self, block_hash: BlockHash, group: int) -> Hashable:
        return block_hash if self.num_groups == 1 else (block_hash, group)

    # -- prefix cache ------------------------------------------------------------------------
    def cached_prefix(
        self, block_hashes: Sequence[BlockHash], token_ids: Sequence[int], max_tokens: int
    ) -> list[int]:
        """Table entries of cached blocks holding the longest prefix of at most `max_tokens`
        tokens. A prefix counts when every full group has all its blocks cached and every
        windowed group the blocks its next query reads (the chained hashes make their
        prefix the same); a windowed group's blocks before those come back as the null
        block, which `allocate` never takes (vLLM's sliding-window hit search)."""
        if not self.pool.enable_caching:
            return []
        bs, n = self.block_size, self.num_groups
        limit = min(len(block_hashes), max_tokens // bs)
        found: list[list[int | None]] = [[] for _ in range(n)]
        full_run = limit  # logical blocks every full group has cached from the start
        for index in range(limit):
            tokens = token_ids[index * bs : (index + 1) * bs]
            for group in range(n):
                block = self.pool.lookup(self._key(block_hashes[index], group), tokens)
                found[group].append(block)
                if block is None and self.group_windows[group] is None:
                    full_run = min(full_run, index)
            if full_run <= index:
                break
        for best in range(full_run, 0, -1):
            if all(self._window_hit(found[g], g, best) for g in range(n)):
                return [
                    NULL_BLOCK if i < self.unread_blocks(best * bs - 1, g) else found[g][i]
                    for i in range(best)
                    for g in range(n)
                ]  # fmt: skip
        return []

    def _window_hit(self, found: list[int | None], group: int, best: int) -> bool:
        """Whether a windowed group's blocks the query after `best` blocks reads are cached."""
        if self.group_windows[group] is None:
            return True
        first = self.unread_blocks(best * self.block_size - 1, group)
        return all(block is not None for block in found[first:best])

    def cache_full_blocks(
        self,
        request_id: str,
        block_hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        num_computed_tokens: int,
        origin: ChainOrigin | None = None,
    ) -> list[tuple[int, Hashable, Sequence[int]]]:
        """Offer the request's blocks that are full and computed to the prefix cache;
        returns those it took, as (block, key, tokens). `origin`: what the request's hash
        root mixes (its first block's KV event carries it)."""
        table = self._tables.get(request_id)
        if table is None or not self.pool.enable_caching:
            return []
        bs, n = self.block_size, self.num_groups
        end = min(len(block_hashes), num_computed_tokens // bs, len(table) // n)
        taken = []
        linked = self.pool.records_events
        for index in range(self._num_cached.get(request_id, 0), end):
            tokens = token_ids[index * bs : (index + 1) * bs]
            link = None
            if linked:
                link = BlockLink(block_hashes[index - 1] if index else None, origin)
            for group in range(n):
                block = table[index * n + group]
                key = self._key(block_hashes[index], group)
                if not self.is_null(block) and self.pool.cache(block, key, tokens, link):
                    taken.append((block, key, tokens))
        self._num_cached[request_id] = max(self._num_cached.get(request_id, 0), end)
        return taken

    def take_kv_events(self, rope_key_of: RopeKeyOf = no_rope_key) -> list[KvCacheEvent]:
        """The KV events since the last take (`rope_key_of`: a prompt's length -> its RoPE
        key, for a first block's extension)."""
        events = self.pool.take_events()
        if events and events[0] is LOST:  # untaken too long: start over from the cache
            return [AllBlocksCleared(self.events.medium), *self.kv_snapshot(rope_key_of)]
        return self.events.convert(events, rope_key_of)

    def kv_snapshot(self, rope_key_of: RopeKeyOf = no_rope_key) -> list[KvCacheEvent]:
        """What the cache holds now, as `BlockStored` events (parents first)."""
        return self.events.snapshot(self.pool.cached(), rope_key_of)

    # -- allocation --------------------------------------------------------------------------
    def _shared_in_range(self, request_id: str, start: int, end: int) -> list[int]:
        """Entries of existing table blocks that tokens [start, end) write and others share."""
        table = self._tables.get(request_id, [])
        if end <= start:
            return []
        n = self.num_groups
        first, last = start // self.block_size * n, ((end - 1) // self.block_size + 1) * n
        return [
            i for i in range(first, min(last, len(table)))
            if self.pool.ref_count(table[i]) > 1 and not self.is_null(table[i])
        ]  # fmt: skip

    def _skipped(self, num_tokens: int, next_position: int) -> set[int]:
        """Entries of a new table that hold the null block: windowed groups' blocks below
        `next_position`'s window."""
        logical = -(-num_tokens // self.block_size)
        n = self.num_groups
        return {
            i * n + g
            for g in range(n)
            for i in range(min(self.unread_blocks(next_position, g), logical))
        }

    def blocks_needed(
        self,
        request_id: str,
        num_tokens: int,
        write_from: int | None = None,
        hits: Sequence[int] = (),
        next_position: int = 0,
    ) -> int:
        """Free blocks that growing the table to `num_tokens` would consume: new blocks,
        copies of shared blocks written from `write_from`, and free cached hits reused
        (for a new table, as `allocate` makes it: none below `next_position`'s window)."""
        table = self._tables.get(request_id)
        entries = self.blocks_for_tokens(num_tokens)
        if table is None:
            skipped = self._skipped(num_tokens, next_position) if self.pool.reserve_null else ()
            missing = sum(1 for i in range(len(hits), entries) if i not in skipped)
            revived = sum(
                1 for i, b in enumerate(hits)
                if i not in skipped and not self.is_null(b) and self.pool.ref_count(b) == 0
            )  # fmt: skip
            return missing + revived
        missing = max(0, entries - len(table))
        copies = (
            0
            if write_from is None
            else len(self._shared_in_range(request_id, write_from, num_tokens))
        )
        return missing + copies

    def can_allocate(
        self,
        request_id: str,
        num_tokens: int,
        reserve: int = 0,
        write_from: int | None = None,
        hits: Sequence[int] = (),
    ) -> bool:
        """True if the table can grow to `num_tokens` with `reserve` blocks left over."""
        needed = self.blocks_needed(request_id, num_tokens, write_from, hits)
        return needed + reserve <= self.pool.num_free

    def allocate(
        self,
        request_id: str,
        num_tokens: int,
        write_from: int | None = None,
        hits: Sequence[int] = (),
        next_position: int = 0,
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Grow the table to hold `num_tokens` (starting from cached `hits`, table entries
        from `cached_prefix`, for a request with no table yet). Returns (table entries
        appended after the hits, (src, dst) copies for shared blocks that tokens from
        `write_from` on will write — the table now holds the dst). A new table for KV
        computed elsewhere, whose next query is at `next_position`, holds the null block
        where no query reads (windowed groups)."""
        table = self._tables.get(request_id)
        n = self.num_groups
        first_new = len(table) if table is not None else len(hits)  # entries returned
        entries = self.blocks_for_tokens(num_tokens)
        if table is None:
            skipped = self._skipped(num_tokens, next_position) if self.pool.reserve_null else ()
            kept = [b for i, b in enumerate(hits) if i not in skipped]
            self.pool.touch(kept)
            fresh = iter(
                self.pool.allocate(sum(1 for i in range(len(hits), entries) if i not in skipped))
            )
            table = self._tables[request_id] = [
                NULL_BLOCK if i in skipped else hits[i] if i < len(hits) else next(fresh)
                for i in range(max(entries, len(hits)))
            ]
            self._num_cached[request_id] = len(hits) // n
            self._trimmed[request_id] = [
                min(self.unread_blocks(next_position, g), len(table) // n) for g in range(n)
            ]
        copies: list[tuple[int, int]] = []
        if write_from is not None:
            for index in self._shared_in_range(request_id, write_from, num_tokens):
                (fresh_block,) = self.pool.allocate(1)
                copies.append((table[index], fresh_block))
                self.pool.decref([table[index]])
                table[index] = fresh_block
                self._num_cached[request_id] = min(self._num_cached.get(request_id, 0), index // n)
        table.extend(self.pool.allocate(max(0, entries - len(table))))
        return table[first_new:], copies

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give `child_id` the parent's table, sharing every block (parallel sampling)."""
        if child_id in self._tables:
            raise ValueError(f"request {child_id} already has blocks")
        table = self._tables[parent_id]
        self.pool.incref(table)
        self._tables[child_id] = list(table)
        self._num_cached[child_id] = self._num_cached.get(parent_id, 0)
        self._trimmed[child_id] = list(self._trimmed.get(parent_id, [0] * self.num_groups))

    def retain(self, request_id: str, until: float) -> int:
        """Keep the request's cached blocks until wall-clock `until` (evicted after every
        unretained free block; `BlockPool.retain`); call before `free`."""
        table = self._tables.get(request_id, ())
        return self.pool.retain((b for b in table if not self.is_null(b)), until)

    def free(self, request_id: str) -> int:
        """Release every block of the request, tail first (so the tail is evicted first)."""
        blocks = [b for b in self._tables.pop(request_id, []) if not self.is_null(b)]
        self._num_cached.pop(request_id, None)
        self._trimmed.pop(request_id, None)
        self.pool.decref(reversed(blocks))
        return len(blocks)

    def check_integrity(self) -> None:
        """Raise AssertionError unless tables, ref counts, queue and index agree exactly."""
        self.pool.check_integrity()
        counts: dict[int, int] = {}
        for blocks in self._tables.values():
            for block in blocks:
                counts[block] = counts.get(block, 0) + 1
        for block in range(self.pool.num_blocks):
            if self.is_null(block):
                continue
            if counts.get(block, 0) != self.pool.ref_count(block):
                raise AssertionError(
                    f"block {block}: {counts.get(block, 0)} table refs, "
                    f"ref count {self.pool.ref_count(block)}"
                )
