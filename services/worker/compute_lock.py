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
_MAX_POLL_S = 1e-3


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
        self.num_timeouts = 0
        self.wait_s = 0.0  # total time spent waiting for other processes

    def run(self, fn: Callable[..., T], *args) -> T:
        acquired = self._acquire()
        try:
            return fn(*args)
        finally:
            if acquired:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _acquire(self) -> bool:
        started = time.perf_counter()
        pause = _FIRST_POLL_S
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.wait_s += time.perf_counter() - started
                return True
            except BlockingIOError:
                pass
            waited = time.perf_counter() - started
            if waited >= self.max_wait_s:
                self.num_timeouts += 1
                self.wait_s += waited
                log.warning(
                    "compute_lock_timeout",
                    path=str(self.path),
                    waited_s=round(waited, 3),
                    note="another worker held the host's compute lock too long; running anyway",
                )
                return False
            time.sleep(pause)
            pause = min(2 * pause, _MAX_POLL_S)

    def close(self) -> None:
        os.close(self._fd)


def make_compute_lock(setting: str, device_type: str) -> ComputeLock | None:
    """The worker's lock for its `cpu_compute_lock` setting: `auto` (the host-wide file on
    CPU, none on accelerators), `off`, or a lock file path shared by the workers that
    should take turns."""
    if setting == "off" or (setting == "auto" and device_type != "cpu"):
        return None
    return ComputeLock(default_lock_path() if setting == "auto" else setting)
