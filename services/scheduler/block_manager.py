"""Block accounting for one worker's paged KV pool: ref-counted blocks and block tables.

The scheduler owns which physical block holds what; the worker only stores bytes. A block
is free exactly when its ref count is 0. Predicate/action pairs (`can_allocate` /
`allocate`) keep the policy readable. Pure Python: no grpc, no torch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


class BlockPool:
    """Physical block ids 0..num_blocks-1 with ref counts and a FIFO free list."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise NoFreeBlocksError(f"asked for {count} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for block in blocks:
            self._ref_counts[block] = 1
        return blocks

    def incref(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            if self._ref_counts[block] == 0:
                raise ValueError(f"block {block} is free; cannot share it")
            self._ref_counts[block] += 1

    def decref(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            if self._ref_counts[block] <= 0:
                raise ValueError(f"block {block} freed twice")
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)

    def check_integrity(self) -> None:
        """Raise AssertionError unless free list and ref counts agree exactly."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("free list holds a block twice")
        for block, refs in enumerate(self._ref_counts):
            if refs < 0:
                raise AssertionError(f"block {block} has ref count {refs}")
            if (refs == 0) != (block in free):
                raise AssertionError(f"block {block}: ref count {refs} but free={refs == 0}")


class BlockManager:
    """Per-request block tables over one BlockPool."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

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

    def num_missing_blocks(self, request_id: str, num_tokens: int) -> int:
        have = len(self._tables.get(request_id, ()))
        return max(0, self.blocks_for_tokens(num_tokens) - have)

    def can_allocate(self, request_id: str, num_tokens: int, reserve: int = 0) -> bool:
        """True if the request's table can grow to hold num_tokens with `reserve` blocks left."""
        return self.num_missing_blocks(request_id, num_tokens) + reserve <= self.pool.num_free

    def allocate(self, request_id: str, num_tokens: int) -> list[int]:
        """Grow the request's table to hold num_tokens; returns the newly added blocks."""
        new_blocks = self.pool.allocate(self.num_missing_blocks(request_id, num_tokens))
        self._tables.setdefault(request_id, []).extend(new_blocks)
        return new_blocks

    def free(self, request_id: str) -> int:
        """Release every block of the request; returns how many it held."""
        blocks = self._tables.pop(request_id, [])
        self.pool.decref(blocks)
        return len(blocks)

    def check_integrity(self) -> None:
        """Raise AssertionError unless tables and ref counts agree exactly."""
        self.pool.check_integrity()
        counts: dict[int, int] = {}
        for blocks in self._tables.values():
            for block in blocks:
                counts[block] = counts.get(block, 0) + 1
        for block in range(self.pool.num_blocks):
            if counts.get(block, 0) != self.pool.ref_count(block):
                raise AssertionError(
                    f"block {block}: {counts.get(block, 0)} table refs, "
                    f"ref count {self.pool.ref_count(block)}"
                )
