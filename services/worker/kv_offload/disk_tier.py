"""The disk tier: one file per full KV block under a folder, LRU by last use, under a
byte budget (`--kv-offload-dir`, `--kv-offload-disk-bytes`); it survives a restart.

Files (`disk_format`) live in a folder of their own per `TierIdentity` (model, geometry,
TP rank, PP stage), so workers of different ranks can share `--kv-offload-dir`. A worker
*claims* its folder (`claim=True`, `folder_claim`): two live workers of one identity (a
prefill and a decode worker of one stack given one `--kv-offload-dir`) take
`<identity>` and `<identity>.1`, each under its own budget, since a tier manages its
folder's files as its own. A restarted worker takes the first folder no live worker
holds (the files there are as good as its own: each is checked on read).
A write goes to a temporary file renamed into place (`os.replace`): a crash
leaves a whole file or none under a block's name, and a stray temporary file that the
next start removes. No fsync: a file torn by a power cut is caught by its length and
checksum, and is a miss.

At start the tier indexes its folder from names and `stat` alone (no file is read):
temporaries are deleted, files of the wrong size are dropped, the rest ordered by mtime
(the tier stamps each write and hit with a strictly increasing mtime, so the LRU order
survives a restart exactly), and the oldest evicted until the budget holds (not reported:
what `keys()` lists after construction is what the tier holds). A `get`
verifies everything (`disk_format.read_block`): any mismatch, truncation or I/O error is
a miss, logged once, the file deleted and its key dropped from the index (collected for
`take_dropped`, so the caller can publish BlockRemoved); a bad file is never served.

Retention (`kv_retention_s`, issue 45): a block saved with a deadline (`put`'s
`retain_until`, or `retain` for one on disk already) is kept in its file's name (see
`disk_format`) and evicted only when no unretained file is left to make room, earliest
deadline first; once the deadline passes it is an ordinary LRU file (`disk_index`). The
scan at start reads the deadlines from the names, so they survive a restart.

Every method may run on any thread (reads and writes are slow: the caller runs them off
its event loop). The index is kept under one lock; file reads and writes, the slow parts,
run outside it. While writes are in flight the folder may exceed the budget by one block
per writer (its temporary file).
"""

from __future__ import annotations

import math
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from common.kv_events import MEDIUM_DISK
from common.log import get_logger
from services.worker.kv_offload.disk_format import (
    HEADER_BYTES,
    TEMP_SUFFIX,
    BadFileError,
    encode_header,
    identity_dir_name,
    parse_name,
    payload_view,
    read_block,
    relative_path,
)
from services.worker.kv_offload.disk_index import DiskFile, DiskIndex
from services.worker.kv_offload.fault_hooks import DiskWriteStall
from services.worker.kv_offload.folder_claim import CLAIM_FILE, FolderClaim
from services.worker.kv_offload.keys import BlockKey, Evicted, TierIdentity, check_root
from services.worker.kv_offload.views import out_bytes


class DiskTier:
    def __init__(
        self,
        folder: str | os.PathLike,
        capacity_bytes: int,
        identity: TierIdentity,
        clock: Callable[[], float] = time.time,
        claim: bool = False,
    ):
        """Index `folder`'s files of `identity` (making the folder if needed). A budget
        below one file (`file_bytes`: header and block) is a disabled tier. `clock`:
        wall-clock seconds, for retention deadlines (tests pass their own). `claim`: take
        the first folder of this identity no live process holds, until `close` or exit."""
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be non-negative, got {capacity_bytes}")
        self.identity = identity
        self.fingerprint = identity.fingerprint
        self.block_bytes = identity.block_bytes
        self.file_bytes = HEADER_BYTES + identity.block_bytes
        self.capacity_bytes = capacity_bytes
        self.capacity_blocks = capacity_bytes // self.file_bytes
        self.folder = Path(folder) / identity_dir_name(self.fingerprint)
        self._claim: FolderClaim | None = None
        self._index = DiskIndex()
        self.clock = clock
        self._dropped: list[Evicted] = []
        self._write_errors: set[str] = set()  # kinds of write failure logged already
        self._last_stamp = 0  # the last mtime stamped, ns
        self._lock = threading.Lock()
        self._fault = DiskWriteStall.from_env()  # tests only (fault_hooks.py)
        if self.enabled:
            if claim:
                self._claim = FolderClaim.first_free(self.folder)
                self.folder = self._claim.folder
            self.folder.mkdir(parents=True, exist_ok=True)
            self._scan()

    def close(self) -> None:
        """Let another tier claim this folder (the process's exit does it too)."""
        if self._claim is not None:
            self._claim.release()
            self._claim = None

    @property
    def enabled(self) -> bool:
        return self.capacity_blocks > 0

    @property
    def bytes_used(self) -> int:
        """Bytes of the files indexed (headers included)."""
        with self._lock:
            return len(self._index) * self.file_bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def keys(self) -> list[BlockKey]:
        """Every block indexed, in the order the tier would evict them (unretained ones
        least recently used first)."""
        with self._lock:
            return list(self._index.keys())

    def retained_until(self, key: BlockKey) -> float:
        """A block's retention deadline, Unix seconds (0: none; it may have passed)."""
        with self._lock:
            return self._index.deadline(key)

    def contains(self, key: BlockKey) -> bool:
        """Whether the block has a file (not verified until read; not a use)."""
        with self._lock:
            return key in self._index

    def put(
        self, key: BlockKey, root: bytes, payload: torch.Tensor, retain_until: float = 0.0
    ) -> list[Evicted]:
        """Write a block (a CPU tensor of exactly `block_bytes`, any dtype) under `root`,
        retained until wall-clock `retain_until` (0: not); returns the blocks evicted to
        make room, in eviction order. A block already on disk is only marked used (and its
        deadline extended, `retain`). A failed write (disk full, ...) stores nothing:
        logged once per kind of failure. Disabled: stores nothing."""
        check_root(root)
        view = payload_view(payload, self.block_bytes)
        if not self.enabled:
            return []
        until = _whole_second(retain_until)
        with self._lock:
            if key in self._index:
                self._touch(key)
                self._extend(key, until)
                return []
        path = self.folder / relative_path(key, until)
        header = encode_header(self.fingerprint, key, root, view)
        temp = self._write_temp(path, header, view, key)
        if temp is None:
            return []
        evicted: list[Evicted] = []
        with self._lock:
            if key in self._index:  # another thread stored it meanwhile
                _unlink(temp)
                self._touch(key)
                self._extend(key, until)
                return []
            while len(self._index) >= self.capacity_blocks:
                evicted.append(self._evict_next("lru"))
            try:
                stamp = self._tick()
                os.utime(temp, ns=(stamp, stamp))
                os.replace(temp, path)
            except OSError as error:
                _unlink(temp)
                self._log_write_error(error)
                return evicted
            self._index.add(key, DiskFile(str(path)), stamp, until, self.clock())
        return evicted

    def retain(self, key: BlockKey, retain_until: float) -> list[Evicted]:
        """Keep a block on disk until wall-clock `retain_until` at least (a later deadline
        than its own: its file is renamed; an earlier one changes nothing); marks it used.
        Nothing when it has no file. Returns [] (nothing is evicted: `put`'s shape)."""
        with self._lock:
            if key in self._index:
                self._touch(key)
                self._extend(key, _whole_second(retain_until))
        return []

    def get(
        self, key: BlockKey, root: bytes, out: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """The block's bytes, verified: a new uint8 tensor `[block_bytes]`, or `out` (a
        contiguous CPU tensor of exactly `block_bytes`, e.g. a pinned staging buffer;
        undefined after a miss). Marks it used. None when absent, or when its file is not
        this block of this identity under `root`, intact: then the file is deleted, the
        miss logged once and the key dropped (see `take_dropped`)."""
        check_root(root)
        if out is not None and out_bytes(out, self.block_bytes).device.type != "cpu":
            raise ValueError(f"the disk tier reads into host tensors, not {out.device}")
        with self._lock:
            entry = self._index.file(key)
        if entry is None:
            return None
        target = (
            torch.empty(self.block_bytes, dtype=torch.uint8)
            if out is None
            else out_bytes(out, self.block_bytes)
        )
        for attempt in range(2):
            try:
                with open(entry.path, "rb", buffering=0) as file:
                    size = os.fstat(file.fileno()).st_size
                    read_block(file, size, self.fingerprint, key, root, self.block_bytes, target)
                break
            except FileNotFoundError:
                with self._lock:
                    current = self._index.file(key)
                if attempt == 0 and current is not None and current is not entry:
                    entry = current  # renamed meanwhile (its deadline moved): read it there
                    continue
                self._drop_if_current(key, entry, "missing: deleted from outside the tier")
                return None
            except BadFileError as bad:
                self._drop_if_current(key, entry, bad.reason)
                return None
            except OSError as error:
                self._drop_if_current(key, entry, f"I/O error: {error}")
                return None
        with self._lock:
            if self._index.file(key) is entry:
                self._touch(key)
        return target if out is None else out

    def remove(self, key: BlockKey) -> bool:
        """Delete a block's file; False when it had none."""
        with self._lock:
            entry = self._index.remove(key)
            if entry is None:
                return False
            _unlink(entry.path)
            return True

    def take_dropped(self) -> list[Evicted]:
        """Blocks dropped by `get` since the last call (their files were bad or gone)."""
        with self._lock:
            dropped, self._dropped = self._dropped, []
            return dropped

    # -- under the lock ---------------------------------------------------------------

    def _tick(self) -> int:
        """A strictly increasing mtime (ns): file system clocks tick in milliseconds, and
        two uses in one tick would lose their order at the next start."""
        self._last_stamp = max(time.time_ns(), self._last_stamp + 1)
        return self._last_stamp

    def _touch(self, key: BlockKey) -> None:
        stamp = self._tick()
        self._index.touch(key, stamp, self.clock())
        try:
            os.utime(self._index.file(key).path, ns=(stamp, stamp))
        except OSError:
            pass  # gone or read-only: the next read finds out; the order is only a hint

    def _extend(self, key: BlockKey, until: int) -> None:
        """A later deadline for an indexed block: its file is renamed to carry it."""
        if until <= self._index.deadline(key):
            return
        entry = self._index.file(key)
        path = str(self.folder / relative_path(key, until))
        try:
            os.replace(entry.path, path)
        except OSError as error:  # gone: the next read finds out
            self._log_write_error(error)
            return
        self._index.retain(key, DiskFile(path), until, self.clock())

    def _evict_next(self, reason: str) -> Evicted:
        """Drop the file the index names next: an unretained one while any is left."""
        key = self._index.victim(self.clock())
        entry = self._index.remove(key)
        _unlink(entry.path)
        return Evicted(key, self.file_bytes, reason)

    def _drop_if_current(self, key: BlockKey, entry: DiskFile, reason: str) -> None:
        """Drop a bad file, unless another thread replaced or removed it meanwhile (then
        what this thread read was not the indexed file: a plain miss, nothing logged)."""
        with self._lock:
            if self._index.file(key) is not entry:
                return
            self._index.remove(key)
            _unlink(entry.path)
            self._dropped.append(Evicted(key, self.file_bytes, reason))
        _log_bad_file(entry.path, key, reason)

    def _log_write_error(self, error: OSError) -> None:
        kind = type(error).__name__ + (f"/{error.errno}" if error.errno else "")
        if kind not in self._write_errors:
            self._write_errors.add(kind)
            get_logger(__name__).warning(
                "kv_offload_disk_write_failed", folder=str(self.folder), error=str(error)
            )

    # -- without the lock --------------------------------------------------------------

    def _write_temp(
        self, path: Path, header: bytes, payload: memoryview, key: BlockKey
    ) -> str | None:
        """Write a block's file beside `path` under a temporary name; its name, or None
        when the write failed (nothing is left behind)."""
        temp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle, temp = tempfile.mkstemp(prefix=".", suffix=TEMP_SUFFIX, dir=path.parent)
            with open(handle, "wb") as file:
                file.write(header)
                if self._fault is not None:
                    self._fault.during_write(file, payload, key.block_hash, temp)
                file.write(payload)
            return temp
        except OSError as error:
            if temp is not None:
                _unlink(temp)
            with self._lock:
                self._log_write_error(error)
            return None

    def _scan(self) -> None:
        """Rebuild the index from the folder (construction only: no other thread yet)."""
        found: dict[BlockKey, tuple[int, str, int]] = {}  # key -> (mtime, path, deadline)
        temporaries = strangers = 0
        for shard in _entries(self.folder):
            if shard.name == CLAIM_FILE:
                continue
            if not shard.is_dir(follow_symlinks=False):
                strangers += 1
                continue
            for item in _entries(shard.path):
                if item.name.endswith(TEMP_SUFFIX):
                    temporaries += _unlink(item.path)
                    continue
                parsed = parse_name(shard.name, item.name)
                if parsed is None or not item.is_file(follow_symlinks=False):
                    strangers += 1
                    continue
                key, until = parsed
                try:
                    stat = item.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.st_size != self.file_bytes:
                    _unlink(item.path)
                    reason = f"size {stat.st_size}, not {self.file_bytes} (torn or foreign)"
                    _log_bad_file(item.path, key, reason)
                    continue
                other = found.get(key)
                if other is not None:  # two names of one block (a crash mid-rename)
                    older = min(other, (stat.st_mtime_ns, item.path, until))
                    _unlink(older[1])
                    if older is other:
                        found[key] = (stat.st_mtime_ns, item.path, until)
                    continue
                found[key] = (stat.st_mtime_ns, item.path, until)
        now = self.clock()
        for key, (mtime, path, until) in sorted(found.items(), key=lambda kv: kv[1][0]):
            self._index.add(key, DiskFile(path), mtime, until, now)
            self._last_stamp = max(self._last_stamp, mtime)
        evicted = 0
        while len(self._index) > self.capacity_blocks:
            self._evict_next("lru")
            evicted += 1
        get_logger(__name__).info(
            "kv_offload_disk_indexed",
            folder=str(self.folder),
            blocks=len(self._index),
            evicted_over_budget=evicted,
            temporaries_removed=temporaries,
            unknown_entries=strangers,
        )


def _entries(folder: str | Path) -> list[os.DirEntry]:
    try:
        with os.scandir(folder) as listing:
            return list(listing)
    except OSError:
        return []


def _whole_second(until: float) -> int:
    """A deadline as its file name keeps it: Unix seconds, rounded up (0: none)."""
    return math.ceil(until) if until > 0 else 0


def _unlink(path: str | os.PathLike) -> int:
    """Delete a file if it is there; 1 when this call deleted it."""
    try:
        os.unlink(path)
        return 1
    except OSError:
        return 0


def _log_bad_file(path: str, key: BlockKey, reason: str) -> None:
    get_logger(__name__).warning(
        "kv_offload_bad_file",
        medium=MEDIUM_DISK,
        path=path,
        block_hash=key.block_hash.hex(),
        group=key.group,
        reason=reason,
    )
