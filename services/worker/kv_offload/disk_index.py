"""The disk tier's index: which file holds each block, in the order the tier evicts them.

Unretained files wait in an LRU queue ordered by their stamp (the strictly increasing
mtime the tier gives each write and use). Files retained until a deadline
(`kv_retention_s`, issue 45) wait apart (`common.retention.RetainedSet`): the tier drops
one only when no unretained file is left, earliest deadline first; once its deadline has
passed a file is an ordinary LRU file again, in its place by stamp. O(log n) per change.
Not thread-safe: `DiskTier` holds its lock around every call. Pure Python.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from common.retention import RetainedSet
from services.worker.kv_offload.keys import BlockKey


@dataclass(frozen=True, eq=False)  # compared by identity: "is this still the indexed file"
class DiskFile:
    path: str


class DiskIndex:
    def __init__(self) -> None:
        self._lru: OrderedDict[BlockKey, None] = OrderedDict()  # unretained, oldest first
        self._retained: RetainedSet[BlockKey] = RetainedSet()
        # key -> (its file, its stamp, its deadline: 0 for none)
        self._files: dict[BlockKey, tuple[DiskFile, int, float]] = {}

    def __len__(self) -> int:
        return len(self._files)

    def __contains__(self, key: object) -> bool:
        return key in self._files

    def file(self, key: BlockKey) -> DiskFile | None:
        found = self._files.get(key)
        return None if found is None else found[0]

    def deadline(self, key: BlockKey) -> float:
        """The file's retention deadline (0: none; it may have passed)."""
        found = self._files.get(key)
        return 0.0 if found is None else found[2]

    def add(self, key: BlockKey, file: DiskFile, stamp: int, until: float, now: float) -> None:
        """Index a file (its stamp newer than every indexed one, unless the caller adds
        files oldest first)."""
        self.remove(key)
        self._files[key] = (file, stamp, until)
        self._place(key, stamp, until, now)

    def touch(self, key: BlockKey, stamp: int, now: float) -> None:
        """The file was used (read or saved again): its stamp is the newest."""
        file, _, until = self._files[key]
        self._unplace(key)
        self._files[key] = (file, stamp, until)
        self._place(key, stamp, until, now)

    def retain(self, key: BlockKey, file: DiskFile, until: float, now: float) -> None:
        """The file (now under `file`: its name carries the deadline) is kept until
        `until`, a later deadline than it had."""
        _, stamp, _ = self._files[key]
        self._unplace(key)
        self._files[key] = (file, stamp, until)
        self._place(key, stamp, until, now)

    def remove(self, key: BlockKey) -> DiskFile | None:
        found = self._files.pop(key, None)
        if found is None:
            return None
        self._unplace(key)
        return found[0]

    def victim(self, now: float) -> BlockKey | None:
        """What the tier evicts next (None: nothing indexed)."""
        head = next(iter(self._lru), None)
        head_stamp = None if head is None else self._files[head][1]
        item = self._retained.next_out(now, head_stamp) if self._retained.live else None
        return head if item is None else item

    def keys(self) -> Iterator[BlockKey]:
        """Every key, unretained ones oldest first, then retained ones by deadline."""
        yield from self._lru
        yield from sorted(self._retained, key=lambda k: (self._files[k][2], self._files[k][1]))

    def _place(self, key: BlockKey, stamp: int, until: float, now: float) -> None:
        if until > now:
            self._retained.add(key, stamp, until)
        else:
            self._lru[key] = None
            self._lru.move_to_end(key)

    def _unplace(self, key: BlockKey) -> None:
        if key in self._lru:
            del self._lru[key]
        else:
            self._retained.discard(key)
