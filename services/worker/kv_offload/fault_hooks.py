"""Fault injection for the disk tier's tests, off unless the environment asks:
`TANDEM_FAULT_DISK_WRITE_STALL=<marker path>:<n>` makes this process's n-th block write
(1-based) stop in the middle: the file's header and half its payload are written and
flushed, the marker file then names the block's hash and the temporary file, and the
writing thread blocks for ever — so a test can SIGKILL the worker at exactly that point
(`tests/service/test_kv_offload_kill.py`). Nothing else changes: every other write runs
as usual (queued behind the stalled one on the tier's single writer thread). Once the
marker exists the hook is off (a restarted worker, same environment, writes as usual).
"""

from __future__ import annotations

import os
import threading
from typing import BinaryIO

ENV = "TANDEM_FAULT_DISK_WRITE_STALL"


class DiskWriteStall:
    def __init__(self, marker: str, nth: int) -> None:
        if nth < 1:
            raise ValueError(f"{ENV}: the write to stall is counted from 1, got {nth}")
        self.marker = marker
        self.nth = nth
        self._count = 0
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls) -> DiskWriteStall | None:
        value = os.environ.get(ENV)
        if not value:
            return None
        marker, _, nth = value.rpartition(":")
        if os.path.exists(marker):  # fired already (this is a restarted worker)
            return None
        return cls(marker, int(nth))

    def during_write(self, file: BinaryIO, payload: memoryview, block_hash: bytes, temp: str):
        """Called after a file's header is written; returns unless this is the write to
        stall (then it never returns)."""
        with self._lock:
            self._count += 1
            if self._count != self.nth:
                return
        file.write(payload[: payload.nbytes // 2])
        file.flush()
        os.fsync(file.fileno())
        staged = self.marker + ".part"
        with open(staged, "w") as note:
            note.write(f"{block_hash.hex()} {temp}\n")
        os.replace(staged, self.marker)
        threading.Event().wait()  # for ever: the test kills the process now
