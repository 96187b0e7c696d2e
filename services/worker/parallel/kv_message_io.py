"""One rank's side of a `common.kv_rank_messages.RankMessage`: its slices of the transfer's
blocks gathered out of the rank's pool into one flat buffer (the sender), or scattered from
one into it (the receiver), and the reused buffers UCX sends from and receives into. Pools
are `[blocks, layers, 2, slot, heads, dim]` holding the rank's stage's layers (numbered from
the stage's first) and its KV heads; a slice that is the whole of that is one block gather
or scatter."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from common.kv_rank_messages import RankMessage


class StagingBuffers:
    """Transfer buffers where the pool is: host memory (numpy, whose array interface UCX
    reads) for a CPU pool, device memory for a GPU pool (UCX moves it itself, `cuda_ipc` on
    one host or `cuda_copy` through its own pipeline). A fresh 64 MiB buffer per transfer
    cost as much as the transfer (page faults on first touch, UCX registering new memory,
    a `cuda_ipc` peer mapping each new allocation): buffers are kept and handed out again.
    A buffer UCX may still hold (a failed or given-up transfer's) is never released."""

    def __init__(self, max_idle: int = 4, device: torch.device | None = None) -> None:
        self.max_idle = max_idle
        self.device = None if device is None or device.type == "cpu" else device
        self._idle: list = []
        self._lock = threading.Lock()  # the tensor thread acquires, the event loop releases
        self.num_allocations = 0

    def acquire(self, nbytes: int):
        """A uint8 buffer of exactly `nbytes` (a numpy array, or a device tensor)."""
        with self._lock:
            fitting = [i for i, b in enumerate(self._idle) if b.nbytes >= nbytes]
            if fitting:  # the smallest that fits (by position: arrays do not compare with ==)
                return self._idle.pop(min(fitting, key=lambda i: self._idle[i].nbytes))[:nbytes]
            self.num_allocations += 1
        if self.device is None:
            return np.empty(nbytes, dtype=np.uint8)[:nbytes]
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)[:nbytes]

    def release(self, view) -> None:
        """Return a buffer from `acquire`; the largest few are kept for reuse."""
        base = view._base if isinstance(view, torch.Tensor) else view.base
        with self._lock:
            self._idle.append(base if base is not None else view)
            self._idle.sort(key=lambda b: b.nbytes, reverse=True)
            del self._idle[self.max_idle :]


def as_tensor(buffer) -> torch.Tensor:
    """A staging buffer's bytes as a uint8 tensor (the same memory)."""
    return buffer if isinstance(buffer, torch.Tensor) else torch.from_numpy(buffer)


def _regions(
    pool: torch.Tensor,
    flat: torch.Tensor,
    num_blocks: int,
    message: RankMessage,
    first_layer: int,
    sending: bool,
) -> Iterator[tuple[slice, slice, torch.Tensor, bool]]:
    """For each slice: this rank's layers and heads of it, its part of `flat` shaped like
    the region, and whether the region is whole blocks of the pool."""
    offset = 0
    _, num_layers, kv, slots, num_heads, dim = pool.shape
    for piece in message.pieces:
        layers = slice(piece.layers.start - first_layer, piece.layers.stop - first_layer)
        first = piece.src_head if sending else piece.dst_head
        heads = slice(first, first + len(piece.heads))
        shape = (num_blocks, len(piece.layers), kv, slots, len(piece.heads), dim)
        nbytes = int(np.prod(shape)) * pool.element_size()
        part = flat[offset : offset + nbytes].view(pool.dtype).view(shape)
        offset += nbytes
        whole = (layers.start, layers.stop, heads.start, heads.stop) == (
            0,
            num_layers,
            0,
            num_heads,
        )
        yield layers, heads, part, whole
    if offset != flat.numel():
        raise ValueError(f"a message of {offset} bytes in a buffer of {flat.numel()}")


def gather_message(
    pool: torch.Tensor,
    block_ids: Sequence[int],
    message: RankMessage,
    first_layer: int,
    flat: torch.Tensor,
) -> None:
    """This (source) rank's slices of the blocks into `flat`, in message order.
    `first_layer`: where the rank's pool starts on the slices' layer axis."""
    index = torch.tensor(block_ids, dtype=torch.long, device=pool.device)
    regions = _regions(pool, flat, len(block_ids), message, first_layer, sending=True)
    for layers, heads, part, whole in regions:
        if whole:
            torch.index_select(pool, 0, index, out=part)
        else:
            part.copy_(pool[index, layers, :, :, heads])


def scatter_message(
    pool: torch.Tensor,
    block_ids: Sequence[int],
    message: RankMessage,
    first_layer: int,
    flat: torch.Tensor,
) -> None:
    """`flat` (a message as `gather_message` wrote it) into this (destination) rank's
    blocks."""
    index = torch.tensor(block_ids, dtype=torch.long, device=pool.device)
    regions = _regions(pool, flat, len(block_ids), message, first_layer, sending=False)
    for layers, heads, part, whole in regions:
        if whole:  # as bytes: no CPU index_copy_ for float8
            pool.view(torch.uint8).index_copy_(0, index, part.view(torch.uint8))
        else:
            pool[index, layers, :, :, heads] = part
