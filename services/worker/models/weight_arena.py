"""Packed CPU weights moved into one anonymous mapping advised for transparent huge pages.

A decode step streams every packed weight from memory once (110 MB for a 32M-parameter
float32 model, 4x this box's last-level cache). On 4 KiB pages that is a TLB miss every
64 cache lines, and in a virtual machine each miss walks two page tables. In one
`MADV_HUGEPAGE` mapping the kernel backs the weights with 2 MiB pages where the host's
transparent huge pages allow it (`enabled` = `always` or `madvise`): Tandem's 16-row
products over 32m's weights took 10.1 -> 9.2 ms, one row 6.7 -> 6.0 ms (2 threads, the same
kernel, interleaved in one process). Elsewhere the advice is ignored and the mapping is plain
memory. One mapping for all the weights, not one per weight: a 1 MiB weight would
otherwise hold a whole 2 MiB page.
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import torch

ALIGN = 64  # bytes: each weight starts on a cache line (the kernels' aligned loads need 32)


class WeightArena:
    """The mapping and the weights in it (views, in the order given)."""

    def __init__(self, weights: Sequence[torch.Tensor]):
        for w in weights:
            if w.device.type != "cpu" or not w.is_contiguous():
                raise ValueError("arena weights must be contiguous CPU tensors")
        offsets, end = [], 0
        for w in weights:
            offsets.append(end)
            end += -(-w.numel() * w.element_size() // ALIGN) * ALIGN
        self.num_bytes = end
        self.huge_pages_advised = False
        self.views: list[torch.Tensor] = []
        if end == 0:
            self._map = None
            return
        self._map = mmap.mmap(-1, end, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if advice is not None:  # Linux; before the first touch, so faults take huge pages
            try:
                self._map.madvise(advice)
                self.huge_pages_advised = True
            except OSError:  # a kernel without transparent huge pages
                pass
        raw = torch.frombuffer(self._map, dtype=torch.uint8)
        for w, offset in zip(weights, offsets, strict=True):
            size = w.numel() * w.element_size()
            view = raw[offset : offset + size].view(w.dtype).view(w.shape)
            view.copy_(w)
            self.views.append(view)
