"""Block accounting for one worker's paged KV pool: ref-counted blocks, block tables, the
prefix cache and copy-on-write.

The scheduler owns which physical block holds what; the worker only stores bytes.

- A block is free exactly when its ref count is 0. Free blocks wait in an O(1) LRU queue
  (`FreeBlockQueue`, a doubly linked list): allocation takes the head, a freed block joins
  the tail, and a prefix-cache hit on a free block takes it out of the middle.
- A full block whose KV is computed can be *cached*: registered in the hash index under its
  chained hash (see `prefix_hash`) together with its token ids. It stays cached while free,
  and is evicted (dropped from the index) only when the free queue hands it out again.
  Every hit compares token ids, so a hash collision can never return the wrong KV.
- Copy-on-write: before a request writes into a block it shares (ref count > 1, e.g. after
  `fork` for parallel sampling), the block is replaced by a fresh copy; the copies to make
  are returned for the worker to run before the step.

- Sliding windows: when every layer of the model attends through a window of W tokens, a
  query at position p reads only keys p - W < k <= p, so a block whose last position is
  before (next query - W + 1) is never read again. `trim` swaps such blocks in a table for
  the *null block* (block 0, reserved in a windowed pool: never allocated, never written,
  zeros on the worker) and frees them, and a table made for KV that is already computed
  (a transfer's or a swap-in's destination) holds the null block there from the start.
  A request then holds about (W + one block) / context of the blocks full attention
  needs. The null block is never cached, copied, shared, freed or moved: transfers and
  swaps skip its pairs (`is_null`).

Predicate/action pairs (`can_allocate` / `allocate`) keep the policy readable. Pure Python.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from common.prefix_hash import BlockHash

NULL_BLOCK = 0  # in a windowed pool: the stand-in for blocks out of every query's window


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


class Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "token_ids", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: BlockHash | None = None
        self.token_ids: tuple[int, ...] = ()
        self.prev: Block | None = None
        self.next: Block | None = None


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

    def remove(self, block: Block) -> None:
        if block.prev is None or block.next is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self._len -= 1


class BlockPool:
    """Physical blocks 0..num_blocks-1: ref counts, the LRU free queue, the hash index."""

    def __init__(
        self, num_blocks: int, enable_caching: bool = True, reserve_null: bool = False
    ) -> None:
        if num_blocks <= int(reserve_null):
            raise ValueError(f"num_blocks must be more than {int(reserve_null)}, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.reserve_null = reserve_null  # block NULL_BLOCK is never handed out
        if reserve_null:
            self.blocks[NULL_BLOCK].ref_count = 1  # held for ever: never in the free queue
        self._free = FreeBlockQueue(b for b in self.blocks if b.ref_count == 0)
        self._cached: dict[BlockHash, Block] = {}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self.blocks[block_id].ref_count

    def allocate(self, count: int) -> list[int]:
        """Take `count` blocks from the head of the free queue (evicting cached ones)."""
        if count > len(self._free):
            raise NoFreeBlocksError(f"asked for {count} blocks, {len(self._free)} free")
        out = []
        for _ in range(count):
            block = self._free.popleft()
            if block.block_hash is not None:
                self._uncache(block)
                self.num_evictions += 1
            block.ref_count = 1
            out.append(block.block_id)
        return out

    def is_null(self, block_id: int) -> bool:
        return self.reserve_null and block_id == NULL_BLOCK

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks found by `lookup` (free ones leave the queue)."""
        for block_id in block_ids:
            if self.is_null(block_id):
                continue
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self._free.remove(block)
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
                self._free.append(block)

    def cache(self, block_id: int, block_hash: BlockHash, token_ids: Sequence[int]) -> bool:
        """Register a full, computed block; False if caching is off or the hash is taken."""
        block = self.blocks[block_id]
        if not self.enable_caching or block.block_hash is not None or self.is_null(block_id):
            return False
        if block_hash in self._cached:
            return False  # another block already holds this prefix; this one stays private
        block.block_hash, block.token_ids = block_hash, tuple(token_ids)
        self._cached[block_hash] = block
        return True

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> int | None:
        """The cached block holding exactly these tokens under this hash, if any."""
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block.block_id

    def _uncache(self, block: Block) -> None:
        del self._cached[block.block_hash]
        block.block_hash, block.token_ids = None, ()

    def reset_cache(self) -> int:
        """Forget every cached block that is free (e.g. the worker lost its KV)."""
        dropped = [b for b in self._cached.values() if b.ref_count == 0]
        for block in dropped:
            self._uncache(block)
        return len(dropped)

    def check_integrity(self) -> None:
        """Raise AssertionError unless queue, ref counts and hash index agree exactly."""
        queued = list(self._free)
        if len(queued) != len(self._free) or len({b.block_id for b in queued}) != len(queued):
            raise AssertionError("free queue is corrupt (length or duplicates)")
        in_queue = {b.block_id for b in queued}
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


class BlockManager:
    """Per-request block tables over one BlockPool, with prefix caching and copy-on-write.
    `window`: every layer's sliding window, in tokens, when all layers have one (the widest);
    blocks out of it are trimmed (module docstring). None: full attention somewhere."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        window: int | None = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if window is not None and window <= 0:
            raise ValueError(f"window must be positive, got {window}")
        self.block_size = block_size
        self.window = window
        self.pool = BlockPool(num_blocks, enable_caching, reserve_null=window is not None)
        self._tables: dict[str, list[int]] = {}
        # Leading blocks of each table already offered to the cache.
        self._num_cached: dict[str, int] = {}
        # Leading blocks of each table already trimmed (the null block, windowed pools).
        self._trimmed: dict[str, int] = {}

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

    def unread_blocks(self, next_position: int) -> int:
        """Leading blocks no query at `next_position` or later reads (0 without a window)."""
        if self.window is None:
            return 0
        return max(0, (next_position - self.window + 1) // self.block_size)

    def trim(self, request_id: str, next_position: int) -> bool:
        """Free the request's blocks that no query from `next_position` on reads, putting the
        null block in their place; whether the table changed (never without a window: this
        runs for every request scheduled)."""
        if self.window is None:
            return False
        table = self._tables.get(request_id)
        end = min(self.unread_blocks(next_position), len(table or ()))
        start = self._trimmed.get(request_id, 0)
        if table is None or end <= start:
            return False
        dropped = [table[i] for i in range(start, end) if not self.is_null(table[i])]
        for index in range(start, end):
            table[index] = NULL_BLOCK
        self._trimmed[request_id] = end
        self.pool.decref(reversed(dropped))
        return bool(dropped)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_requests(self) -> int:
        return len(self._tables)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def table(self, request_id: str) -> list[int]:
        return list(self._tables.get(request_id, ()))

    def has(self, request_id: str) -> bool:
        return request_id in self._tables

    # -- prefix cache ------------------------------------------------------------------------
    def cached_prefix(
        self, block_hashes: Sequence[BlockHash], token_ids: Sequence[int], max_tokens: int
    ) -> list[int]:
        """Cached blocks holding the longest prefix of at most `max_tokens` tokens. With a
        window, a prefix counts when the blocks its next query reads are cached (the
        chained hashes make their prefix the same); the blocks before them come back as
        the null block, which `allocate` never takes (vLLM's sliding-window hit search)."""
        hits: list[int] = []
        if not self.pool.enable_caching:
            return hits
        bs = self.block_size
        limit = min(len(block_hashes), max_tokens // bs)
        if self.window is not None:
            return self._windowed_prefix(block_hashes, token_ids, limit)
        for index in range(limit):
            block = self.pool.lookup(block_hashes[index], token_ids[index * bs : (index + 1) * bs])
            if block is None:
                break
            hits.append(block)
        return hits

    def _windowed_prefix(
        self, block_hashes: Sequence[BlockHash], token_ids: Sequence[int], limit: int
    ) -> list[int]:
        bs = self.block_size
        found: list[int | None] = []
        best, run_start = 0, 0  # run_start: first block of the cached run ending here
        for index in range(limit):
            block = self.pool.lookup(block_hashes[index], token_ids[index * bs : (index + 1) * bs])
            found.append(block)
            if block is None:
                run_start = index + 1
            elif run_start <= self.unread_blocks((index + 1) * bs - 1):
                best = index + 1  # the last query of the prefix reads only cached blocks
        unread = self.unread_blocks(best * bs - 1) if best else 0
        return [NULL_BLOCK if i < unread else found[i] for i in range(best)]

    def cache_full_blocks(
        self,
        request_id: str,
        block_hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        num_computed_tokens: int,
    ) -> None:
        """Offer the request's blocks that are full and computed to the prefix cache."""
        table = self._tables.get(request_id)
        if table is None or not self.pool.enable_caching:
            return
        bs = self.block_size
        end = min(len(block_hashes), num_computed_tokens // bs, len(table))
        for index in range(self._num_cached.get(request_id, 0), end):
            if self.is_null(table[index]):
                continue
            tokens = token_ids[index * bs : (index + 1) * bs]
            self.pool.cache(table[index], block_hashes[index], tokens)
        self._num_cached[request_id] = max(self._num_cached.get(request_id, 0), end)

    # -- allocation --------------------------------------------------------------------------
    def _shared_in_range(self, request_id: str, start: int, end: int) -> list[int]:
        """Indices of existing table blocks that tokens [start, end) write and others share."""
        table = self._tables.get(request_id, [])
        if end <= start:
            return []
        first, last = start // self.block_size, (end - 1) // self.block_size
        return [
            i for i in range(first, min(last + 1, len(table)))
            if self.pool.ref_count(table[i]) > 1 and not self.is_null(table[i])
        ]  # fmt: skip

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
        skip = 0
        if table is None:
            skip = min(self.unread_blocks(next_position), self.blocks_for_tokens(num_tokens))
        have = len(table) if table else max(len(hits), skip)
        missing = max(0, self.blocks_for_tokens(num_tokens) - have)
        copies = (
            0
            if write_from is None
            else len(self._shared_in_range(request_id, write_from, num_tokens))
        )
        revived = sum(1 for b in hits[skip:] if self.pool.ref_count(b) == 0)
        return missing + copies + revived

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
        """Grow the table to hold `num_tokens` (starting from cached `hits` for a request
        with no table yet). Returns (table entries appended after the hits, (src, dst)
        copies for shared blocks that tokens from `write_from` on will write — the table
        now holds the dst). A new table for KV computed elsewhere, whose next query is at
        `next_position`, holds the null block where no query reads (windowed pools)."""
        table = self._tables.get(request_id)
        first_new = len(table) if table is not None else len(hits)  # entries returned
        if table is None:
            table = self._tables[request_id] = []
            skip = min(self.unread_blocks(next_position), self.blocks_for_tokens(num_tokens))
            self.pool.touch(hits[skip:])
            table.extend([NULL_BLOCK] * skip)
            table.extend(hits[skip:])
            self._num_cached[request_id] = len(hits)
            self._trimmed[request_id] = skip
        copies: list[tuple[int, int]] = []
        if write_from is not None:
            for index in self._shared_in_range(request_id, write_from, num_tokens):
                (fresh,) = self.pool.allocate(1)
                copies.append((table[index], fresh))
                self.pool.decref([table[index]])
                table[index] = fresh
                self._num_cached[request_id] = min(self._num_cached.get(request_id, 0), index)
        new_blocks = self.pool.allocate(max(0, self.blocks_for_tokens(num_tokens) - len(table)))
        table.extend(new_blocks)
        return table[first_new:], copies

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give `child_id` the parent's table, sharing every block (parallel sampling)."""
        if child_id in self._tables:
            raise ValueError(f"request {child_id} already has blocks")
        table = self._tables[parent_id]
        self.pool.incref(table)
        self._tables[child_id] = list(table)
        self._num_cached[child_id] = self._num_cached.get(parent_id, 0)
        self._trimmed[child_id] = self._trimmed.get(parent_id, 0)

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
