"""Reusable host buffers for KV transfers.

A fresh 64 MiB buffer per transfer costs as much as the transfer itself (page faults on
first touch, and UCX registers new memory each time); buffers here are allocated once,
kept, and handed out again, one per concurrent transfer.
"""

from __future__ import annotations

import numpy as np


class StagingBuffers:
    def __init__(self, max_idle: int = 4) -> None:
        self.max_idle = max_idle
        self._idle: list[np.ndarray] = []
        self.num_allocations = 0

    def acquire(self, nbytes: int) -> np.ndarray:
        """A uint8 array of exactly `nbytes`, backed by a buffer that may be reused."""
        fitting = [i for i, b in enumerate(self._idle) if b.nbytes >= nbytes]
        if fitting:  # the smallest that fits (by position: arrays do not compare with ==)
            buffer = self._idle.pop(min(fitting, key=lambda i: self._idle[i].nbytes))
        else:
            buffer = np.empty(nbytes, dtype=np.uint8)
            self.num_allocations += 1
        return buffer[:nbytes]

    def release(self, view: np.ndarray) -> None:
        """Return a buffer from `acquire`; the largest few are kept for reuse."""
        buffer = view.base if view.base is not None else view
        self._idle.append(buffer)
        self._idle.sort(key=lambda b: b.nbytes, reverse=True)
        del self._idle[self.max_idle :]
