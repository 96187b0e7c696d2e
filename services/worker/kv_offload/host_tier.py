"""The host-memory tier: an LRU of full KV blocks in one preallocated slab of fixed-size
block slots, under a byte budget (`--kv-offload-cpu-bytes`).

The slab is one uint8 tensor `[capacity_blocks, block_bytes]`, allocated once: pinned
(page-locked) when asked for and CUDA is there, so that copies between it and the GPU pool
can run asynchronously on the connector's own stream; a plain tensor on CPU, where the pool
itself is host memory and this tier is a second, cheaper budget. A zero budget (or one
smaller than a block) is a disabled tier: it holds nothing and every get misses.

Each entry keeps the salted root it was stored under: a get under another root is never
served (cache_salt isolation), and the entry is dropped. A `put` beyond capacity evicts
the least recently used block and returns it (`Evicted`, with a copy of its bytes when
`keep_evicted`, so the caller can demote it to disk); blocks dropped by a `get` are
collected for `take_dropped`. Every method takes one lock, so the index stays consistent
when threads share the tier; a view returned by `get` stays valid until the next
`put`/`remove` that reuses its slot: pass `out` to copy under the lock instead.

Copies run on whatever CUDA stream is current (the caller's `torch.cuda.stream(...)`),
non-blocking when the slab is pinned: the caller synchronizes that stream before it
reuses a source, reads a destination, or calls `put` again (an eviction copies a slot's
bytes out on the CPU).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from common.log import get_logger
from services.worker.kv_offload.keys import BlockKey, Evicted, Medium, check_root
from services.worker.kv_offload.views import as_bytes, out_bytes


@dataclass(frozen=True)
class _Entry:
    slot: int
    root: bytes


class HostTier:
    def __init__(
        self,
        capacity_bytes: int,
        block_bytes: int,
        pin_memory: bool = False,
        keep_evicted: bool = False,
    ) -> None:
        """`pin_memory`: page-locked slab when CUDA is available (ignored without it);
        `keep_evicted`: LRU victims come back with a copy of their bytes."""
        if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes <= 0:
            raise ValueError(f"block_bytes must be a positive int, got {block_bytes!r}")
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be non-negative, got {capacity_bytes}")
        self.block_bytes = block_bytes
        self.capacity_blocks = capacity_bytes // block_bytes
        self.pinned = bool(pin_memory and torch.cuda.is_available() and self.capacity_blocks)
        self.keep_evicted = keep_evicted
        self._slab = torch.empty(
            (self.capacity_blocks, block_bytes), dtype=torch.uint8, pin_memory=self.pinned
        )
        self._free = list(range(self.capacity_blocks - 1, -1, -1))  # pop() takes slot 0 first
        self._index: OrderedDict[BlockKey, _Entry] = OrderedDict()  # oldest first
        self._dropped: list[Evicted] = []
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.capacity_blocks > 0

    @property
    def bytes_used(self) -> int:
        with self._lock:
            return len(self._index) * self.block_bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def keys(self) -> list[BlockKey]:
        """Every block held, least recently used first."""
        with self._lock:
            return list(self._index)

    def contains(self, key: BlockKey) -> bool:
        """Whether the block is held (does not count as a use)."""
        with self._lock:
            return key in self._index

    def put(self, key: BlockKey, root: bytes, src: torch.Tensor) -> list[Evicted]:
        """Copy a block in (any dtype and device, exactly `block_bytes`); returns the blocks
        this pushed out, oldest first. A block already held is only marked used (equal
        hashes under one root mean equal KV). Disabled: stores nothing."""
        check_root(root)
        data = as_bytes(src, self.block_bytes)
        if not self.enabled:
            return []
        evicted: list[Evicted] = []
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return []
            if not self._free:
                victim, entry = self._index.popitem(last=False)
                payload = self._slab[entry.slot].clone() if self.keep_evicted else None
                evicted.append(
                    Evicted(victim, Medium.CPU, entry.root, self.block_bytes, "lru", payload)
                )
                self._free.append(entry.slot)
            slot = self._free.pop()
            self._slab[slot].copy_(data, non_blocking=self.pinned)
            self._index[key] = _Entry(slot, root)
        return evicted

    def get(
        self, key: BlockKey, root: bytes, out: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The block's bytes (uint8 `[block_bytes]`): a view of its slot, or copied into
        `out` (any dtype and device, exactly `block_bytes`) under the lock. Marks it used.
        None when absent, or held under another root (then dropped: see `take_dropped`)."""
        check_root(root)
        target = None if out is None else out_bytes(out, self.block_bytes)
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                return None
            if entry.root != root:
                self._drop(key, entry, "foreign")
                return None
            self._index.move_to_end(key)
            slot = self._slab[entry.slot]
            if target is None:
                return slot
            target.copy_(slot, non_blocking=self.pinned)
            return out

    def remove(self, key: BlockKey) -> bool:
        """Forget a block (its slot is free again); False when it was not held."""
        with self._lock:
            entry = self._index.pop(key, None)
            if entry is None:
                return False
            self._free.append(entry.slot)
            return True

    def take_dropped(self) -> list[Evicted]:
        """Blocks dropped by `get` since the last call (held under another root)."""
        with self._lock:
            dropped, self._dropped = self._dropped, []
            return dropped

    def _drop(self, key: BlockKey, entry: _Entry, reason: str) -> None:
        del self._index[key]
        self._free.append(entry.slot)
        self._dropped.append(Evicted(key, Medium.CPU, entry.root, self.block_bytes, reason))
        get_logger(__name__).warning(
            "kv_offload_block_dropped",
            medium=Medium.CPU.value,
            block_hash=key.block_hash.hex(),
            group=key.group,
            reason=reason,
        )
