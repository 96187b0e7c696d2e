"""One model computation at a time per host: a lock that CPU workers sharing cores take
around every piece of tensor work (forward passes, block copies, KV gathers and scatters).

Each CPU worker's torch runs an OpenMP team as wide as the machine. When a prefill and a
decode worker compute at once on the same cores, their teams preempt each other inside
parallel regions and every barrier waits for a descheduled thread: both run several times
slower than one after the other (measured: output throughput 244 vs 373 tok/s at
concurrency 16 on 2 cores, TTFT 2.3 s vs 0.6 s). Taking turns gives each pass every core,
the way one GPU time-slices two processes.

The lock is an advisory `flock` on a file, so the kernel releases it when a holder dies. A
holder that is frozen (SIGSTOP, a debugger) must not stall the host: waiting is bounded by
`max_wait_s`, after which the work runs without the lock (logged).

Turns are fair: `flock` has no queue, and a decode worker whose steps run back to back
takes the lock again microseconds after releasing it, so a polling prefill worker could
wait for a gap in the decode stream. A waiter therefore holds a shared lock on a second
file (`<path>.want`) while it waits; a process about to take the lock first checks that
file and, if another process wants a turn, lets it go first (bounded by `_COURTESY_S`).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from common.log import get_logger

log = get_logger(__name__)
T = TypeVar("T")

# Polling backoff while another process holds the lock (seconds).
_FIRST_POLL_S = 50e-6
_MAX_POLL_S = 250e-6
# How long a process about to take the lock waits for a waiting process to take it first.
_COURTESY_S = 2e-3


def default_lock_path() -> Path:
    """The host-wide lock file of this user's workers."""
    return Path(tempfile.gettempdir()) / f"tandem-cpu-compute-{os.getuid()}.lock"


class ComputeLock:
    """`run(fn)`: call `fn` while holding the host's compute lock."""

    def __init__(self, path: str | os.PathLike, max_wait_s: float = 2.0) -> None:
        if max_wait_s <= 0:
            raise ValueError(f"max_wait_s must be > 0, got {max_wait_s}")
        self.path = Path(path)
        self.max_wait_s = max_wait_s
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self._want_fd = os.open(f"{self.path}.want", os.O_RDWR | os.O_CREAT, 0o600)
        self.num_timeouts = 0
        self.num_turns_given = 0  # times this process let a waiting one go first
        self.wait_s = 0.0  # total time spent waiting for other processes

    def run(self, fn: Callable[..., T], *args) -> T:
        acquired = self._acquire()
        try:
            return fn(*args)
        finally:
            if acquired:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _try(self, fd: int, operation: int) -> bool:
        try:
            fcntl.flock(fd, operation | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def _others_want(self) -> bool:
        """Whether another process is waiting for the lock (holds `<path>.want` shared)."""
        if self._try(self._want_fd, fcntl.LOCK_EX):
            fcntl.flock(self._want_fd, fcntl.LOCK_UN)
            return False
        return True

    def _give_way(self) -> None:
        """Let a process that is already waiting take its turn first."""
        if not self._others_want():
            return
        self.num_turns_given += 1
        deadline = time.perf_counter() + _COURTESY_S
        while self._others_want() and time.perf_counter() < deadline:
            time.sleep(_FIRST_POLL_S)

    def _acquire(self) -> bool:
        started = time.perf_counter()
        self._give_way()
        pause = _FIRST_POLL_S
        wanting = False
        try:
            while True:
                if self._try(self._fd, fcntl.LOCK_EX):
                    self.wait_s += time.perf_counter() - started
                    return True
                if not wanting:  # (a holder's probe can make this fail: retried next poll)
                    wanting = self._try(self._want_fd, fcntl.LOCK_SH)
                waited = time.perf_counter() - started
                if waited >= self.max_wait_s:
                    self.num_timeouts += 1
                    self.wait_s += waited
                    log.warning(
                        "compute_lock_timeout",
                        path=str(self.path),
                        waited_s=round(waited, 3),
                        note="another worker held the host's compute lock too long; "
                        "running anyway",
                    )
                    return False
                time.sleep(pause)
                pause = min(2 * pause, _MAX_POLL_S)
        finally:
            if wanting:
                fcntl.flock(self._want_fd, fcntl.LOCK_UN)

    def close(self) -> None:
        os.close(self._fd)
        os.close(self._want_fd)


def make_compute_lock(setting: str, device_type: str) -> ComputeLock | None:
    """The worker's lock for its `cpu_compute_lock` setting: `auto` (the host-wide file on
    CPU, none on accelerators), `off`, or a lock file path shared by the workers that
    should take turns."""
    if setting == "off" or (setting == "auto" and device_type != "cpu"):
        return None
    return ComputeLock(default_lock_path() if setting == "auto" else setting)
