"""Reusable staging buffers for KV transfers over UCX: host memory for a CPU pool, device
memory for a GPU pool (so UCX moves device memory itself, with `cuda_ipc` on one host or
`cuda_copy` through its own pipeline, and the blocks never take a trip through a host
copy made by the worker).

A fresh 64 MiB buffer per transfer costs as much as the transfer itself (page faults on
first touch, and UCX registers new memory each time; a `cuda_ipc` peer maps each new device
allocation, which costs far more); buffers here are allocated once, kept, and handed out
again, one per concurrent transfer.
"""

from __future__ import annotations

import numpy as np
import torch


class StagingBuffers:
    def __init__(self, max_idle: int = 4, device: torch.device | None = None) -> None:
        """Host (numpy) buffers, or uint8 torch tensors on `device` when it is not the CPU."""
        self.max_idle = max_idle
        self.device = None if device is None or device.type == "cpu" else device
        self._idle: list = []
        self.num_allocations = 0

    def acquire(self, nbytes: int):
        """A uint8 buffer of exactly `nbytes` (a numpy array, or a device tensor), backed by
        a buffer that may be reused."""
        fitting = [i for i, b in enumerate(self._idle) if b.nbytes >= nbytes]
        if fitting:  # the smallest that fits (by position: arrays do not compare with ==)
            buffer = self._idle.pop(min(fitting, key=lambda i: self._idle[i].nbytes))
        elif self.device is None:
            buffer = np.empty(nbytes, dtype=np.uint8)
            self.num_allocations += 1
        else:
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self.num_allocations += 1
        return buffer[:nbytes]

    def release(self, view) -> None:
        """Return a buffer from `acquire`; the largest few are kept for reuse."""
        base = view._base if isinstance(view, torch.Tensor) else view.base
        self._idle.append(base if base is not None else view)
        self._idle.sort(key=lambda b: b.nbytes, reverse=True)
        del self._idle[self.max_idle :]
