"""One poll loop per same-host peer for every pull waiting on its progress.

A pull that waits for a peer's next layer does not poll itself: it awaits
`ProgressWatch.changed()`, which one task per peer resolves when the peer's progress word
moves or the peer exits. That task polls on a schedule learnt from the peer's pace: after
a change it sleeps until shortly before the next change is due (80% of the last interval
between changes, at most `MAX_SLEEP_S`), then looks every `MIN_SLEEP_S`, backing off to
`BACKOFF_MAX_S` if the change is late. So a prompt whose layers take 300 ms each costs a
few polls per layer, and its last layer is still seen within about half a millisecond.
Nobody waiting, the task ends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

MIN_SLEEP_S = 0.0005
BACKOFF_MAX_S = 0.004
MAX_SLEEP_S = 0.05


class ProgressWatch:
    def __init__(self, read: Callable[[], int], alive: Callable[[], bool]) -> None:
        """`read` returns the peer's progress word; `alive` whether the peer still runs."""
        self._read = read
        self._alive = alive
        self._changed = asyncio.Event()
        self._waiting = 0
        self._task: asyncio.Task | None = None
        self._last_change = time.monotonic()
        self._pace = 0.0  # the last interval between two changes (0: unknown)

    async def changed(self, timeout_s: float) -> None:
        """Return when the progress moved or the peer exited (or after `timeout_s`)."""
        event = self._changed
        self._waiting += 1
        try:
            if self._task is None or self._task.done():
                self._task = asyncio.ensure_future(self._poll())
            try:
                await asyncio.wait_for(event.wait(), timeout_s)
            except TimeoutError:
                pass
        finally:
            self._waiting -= 1

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _poll(self) -> None:
        seen, sleep_s = self._read(), MIN_SLEEP_S
        while self._waiting:
            await asyncio.sleep(self._next_sleep(sleep_s))
            now, progress = time.monotonic(), self._read()
            if progress != seen or not self._alive():
                if progress != seen:
                    self._pace, self._last_change = now - self._last_change, now
                seen, sleep_s = progress, MIN_SLEEP_S
                event, self._changed = self._changed, asyncio.Event()
                event.set()
            else:
                sleep_s = min(2 * sleep_s, BACKOFF_MAX_S)

    def _next_sleep(self, sleep_s: float) -> float:
        """Sleep through most of the expected wait for the next change, then poll."""
        due = self._last_change + 0.8 * self._pace - time.monotonic()
        return min(MAX_SLEEP_S, due) if due > sleep_s else sleep_s
