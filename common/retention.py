"""Retention hints (issue 45, `kv_retention_s`): the free items of a cache tier that are
kept until a deadline, in the order they are evicted — after every unretained free item.

`RetainedSet` holds the retained free items of one tier (the scheduler's device and host
block pools, the worker's disk tier each keep one beside their plain LRU queue):
- an item retained past `now` waits in a heap by (deadline, last use): when a tier has
  nothing else left to evict, the earliest deadline goes first;
- `expire(now)` moves every item whose deadline passed into a second heap, by last use:
  an expired item is an ordinary LRU item again, and its owner compares the oldest of
  them (`oldest_expired`) with the head of its own LRU queue to evict in true LRU order.
Every operation is O(log n) (removal is lazy: a stale heap entry is skipped when it
reaches the top, so each entry is pushed and popped once). `last_use` values are the
owner's strictly increasing stamps, compared with its LRU queue's.

Deadlines are wall-clock seconds (`time.time()`): the disk tier keeps them across a
restart, and the scheduler sends them to the worker as they are. Pure Python.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

Item = TypeVar("Item", bound=Hashable)


@dataclass(frozen=True)
class RetentionLimits:
    """How long a request may ask its KV to be kept (`--max-kv-retention-s`)."""

    max_s: float = 3600.0

    def __post_init__(self) -> None:
        if not 0 <= self.max_s < float("inf"):
            raise ValueError(f"max_kv_retention_s must be finite and >= 0, got {self.max_s}")

    def problem(self, value: float) -> str | None:
        """Why `value` is no valid `kv_retention_s` (None: it is)."""
        if value != value or value in (float("inf"), float("-inf")):
            return f"kv_retention_s must be finite, got {value}"
        if value < 0:
            return f"kv_retention_s must be >= 0, got {value}"
        if value > self.max_s:
            return f"kv_retention_s must be <= {self.max_s:g} (--max-kv-retention-s), got {value:g}"
        return None


class RetainedSet(Generic[Item]):
    """The retained free items of one tier (see the module docstring)."""

    def __init__(self) -> None:
        self._retained: list[tuple[float, int, Item]] = []  # (deadline, last use, item)
        self._expired: list[tuple[int, float, Item]] = []  # (last use, deadline, item)
        # item -> (last use, deadline, expired): what its live heap entry says. Public
        # for a hot path's emptiness check (a dict's truth is cheaper than `len(self)`).
        self.live: dict[Item, tuple[int, float, bool]] = {}

    def __len__(self) -> int:
        return len(self.live)

    def __contains__(self, item: object) -> bool:
        return item in self.live

    def __iter__(self):
        return iter(self.live)

    def deadline(self, item: Item) -> float | None:
        entry = self.live.get(item)
        return None if entry is None else entry[1]

    def add(self, item: Item, last_use: int, deadline: float) -> None:
        """The item is free and retained until `deadline` (replacing what it was)."""
        self.live[item] = (last_use, deadline, False)
        heapq.heappush(self._retained, (deadline, last_use, item))

    def discard(self, item: Item) -> bool:
        """The item is no longer free here (used again, or gone); False if it was not."""
        return self.live.pop(item, None) is not None

    def expire(self, now: float) -> None:
        """Items whose deadline is `now` or earlier become plain LRU items."""
        heap = self._retained
        while heap and heap[0][0] <= now:
            deadline, last_use, item = heapq.heappop(heap)
            if self.live.get(item) == (last_use, deadline, False):
                self.live[item] = (last_use, deadline, True)
                heapq.heappush(self._expired, (last_use, deadline, item))

    def oldest_expired(self) -> tuple[int, Item] | None:
        """(last use, item) of the least recently used expired item (None: none)."""
        heap = self._expired
        while heap:
            last_use, deadline, item = heap[0]
            if self.live.get(item) == (last_use, deadline, True):
                return last_use, item
            heapq.heappop(heap)
        return None

    def earliest(self) -> Item | None:
        """The item retained the shortest (the last resort of a full tier; None: none).
        Call `expire` first, or it may be an expired one's leftover entry."""
        heap = self._retained
        while heap:
            deadline, last_use, item = heap[0]
            if self.live.get(item) == (last_use, deadline, False):
                return item
            heapq.heappop(heap)
        return None

    def next_out(self, now: float, lru_head_use: int | None) -> Item | None:
        """What the tier evicts next, given the last use of its LRU queue's head (None:
        the queue is empty): the oldest expired item if it is older than the head, else
        None (take the head); with an empty queue and nothing expired, the earliest
        deadline."""
        self.expire(now)
        expired = self.oldest_expired()
        if expired is not None and (lru_head_use is None or expired[0] < lru_head_use):
            return expired[1]
        if lru_head_use is None:
            return self.earliest()
        return None
