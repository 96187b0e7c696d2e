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
A waiting process blocks in `flock` on a helper thread and uses no CPU (polling for the
lock took ~10% of a core from the worker computing); the kernel wakes it on release.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from common.log import get_logger

log = get_logger(__name__)
T = TypeVar("T")

# How long a process about to take the lock waits for a waiting process to take it first,
# and how often it looks (seconds).
_COURTESY_S = 2e-3
_COURTESY_POLL_S = 50e-6


def default_lock_path() -> Path:
    """The host-wide lock file of this user's workers."""
    return Path(tempfile.gettempdir()) / f"tandem-cpu-compute-{os.getuid()}.lock"


class _BlockingWaiter:
    """Takes the lock with a blocking `flock` on a helper thread, so that waiting costs no
    CPU; the caller waits on a condition with a timeout (`flock` has none). If the caller
    gives up, the helper releases the lock as soon as it gets it."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._cv = threading.Condition()
        self._next_id = 0
        self._pending: int | None = None  # the request the helper should take the lock for
        self._granted: int | None = None  # the last request it took the lock for
        self._closed = False
        self.busy = False  # the helper is in (or about to enter) its flock
        self._thread = threading.Thread(target=self._loop, name="compute-lock", daemon=True)
        self._thread.start()

    def wait(self, timeout_s: float) -> bool:
        """Whether the lock was taken (held on the shared fd) within `timeout_s`."""
        with self._cv:
            self._next_id += 1
            request = self._pending = self._next_id
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._granted == request, timeout=max(0.0, timeout_s))
            if self._granted == request:
                return True
            self._pending = None  # given up: the helper releases the lock when it gets it
            return False

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._pending is not None or self._closed)
                if self._closed:
                    return
                self.busy = True
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
            except OSError:  # the fd was closed under us: the worker is shutting down
                return
            with self._cv:
                if self._pending is not None:  # (a newer request if the first gave up)
                    self._granted, self._pending = self._pending, None
                    self._cv.notify_all()
                else:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
                self.busy = False

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()


class ComputeLock:
    """`run(fn)`: call `fn` while holding the host's compute lock."""

    def __init__(self, path: str | os.PathLike, max_wait_s: float = 2.0) -> None:
        if max_wait_s <= 0:
            raise ValueError(f"max_wait_s must be > 0, got {max_wait_s}")
        self.path = Path(path)
        self.max_wait_s = max_wait_s
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self._want_fd = os.open(f"{self.path}.want", os.O_RDWR | os.O_CREAT, 0o600)
        self._waiter = _BlockingWaiter(self._fd)
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
            time.sleep(_COURTESY_POLL_S)

    def _acquire(self) -> bool:
        started = time.perf_counter()
        self._give_way()
        # (While the helper still waits for a lock the caller gave up on, only the helper
        # may take it: both share the fd, and the helper releases what it was not asked
        # for.)
        if not self._waiter.busy and self._try(self._fd, fcntl.LOCK_EX):
            self.wait_s += time.perf_counter() - started
            return True
        fcntl.flock(self._want_fd, fcntl.LOCK_SH)  # others now see this process waiting
        try:
            granted = self._waiter.wait(self.max_wait_s - (time.perf_counter() - started))
        finally:
            fcntl.flock(self._want_fd, fcntl.LOCK_UN)
        waited = time.perf_counter() - started
        self.wait_s += waited
        if granted:
            return True
        self.num_timeouts += 1
        log.warning(
            "compute_lock_timeout",
            path=str(self.path),
            waited_s=round(waited, 3),
            note="another worker held the host's compute lock too long; running anyway",
        )
        return False

    def close(self) -> None:
        self._waiter.close()
        if not self._waiter.busy:  # a helper blocked in flock keeps the fd until exit
            os.close(self._fd)
        os.close(self._want_fd)


def make_compute_lock(
    setting: str, device_type: str, max_wait_s: float = 2.0
) -> ComputeLock | None:
    """The worker's lock for its `cpu_compute_lock` setting: `auto` (the host-wide file on
    CPU, none on accelerators), `off`, or a lock file path shared by the workers that
    should take turns."""
    if setting == "off" or (setting == "auto" and device_type != "cpu"):
        return None
    return ComputeLock(default_lock_path() if setting == "auto" else setting, max_wait_s)
