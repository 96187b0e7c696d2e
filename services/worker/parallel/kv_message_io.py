"""One rank's side of a `common.kv_rank_messages.RankMessage`: its slices of the transfer's
blocks gathered out of the rank's pool into one flat buffer (the sender), or scattered from
one into it (the receiver). Pools are `[blocks, layers, 2, slot, heads, dim]` holding the
rank's stage's layers (numbered from the stage's first) and its KV heads; a slice that is
the whole of that is one block gather or scatter."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from common.kv_rank_messages import RankMessage
from common.parallel_plan import KvSlice


def new_buffer(nbytes: int, device: torch.device) -> tuple[object, torch.Tensor]:
    """A transfer buffer: (what UCX is given, the same bytes as a uint8 tensor). Host
    buffers are numpy arrays (UCX reads their array interface), device ones tensors."""
    if device.type == "cpu":
        array = np.empty(nbytes, dtype=np.uint8)
        return array, torch.from_numpy(array)
    tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return tensor, tensor


def _regions(
    pool: torch.Tensor, flat: torch.Tensor, num_blocks: int, message: RankMessage, sending: bool
) -> Iterator[tuple[KvSlice, slice, torch.Tensor]]:
    """(slice, this rank's heads of it, its part of `flat` shaped like the region)."""
    offset = 0
    _, _, kv, slots, _, dim = pool.shape
    for piece in message.pieces:
        first = piece.src_head if sending else piece.dst_head
        heads = slice(first, first + len(piece.heads))
        shape = (num_blocks, len(piece.layers), kv, slots, len(piece.heads), dim)
        nbytes = int(np.prod(shape)) * pool.element_size()
        part = flat[offset : offset + nbytes].view(pool.dtype).view(shape)
        offset += nbytes
        yield piece, heads, part
    if offset != flat.numel():
        raise ValueError(f"a message of {offset} bytes in a buffer of {flat.numel()}")


def _layers(piece: KvSlice, first_layer: int) -> slice:
    return slice(piece.layers.start - first_layer, piece.layers.stop - first_layer)


def _whole(pool: torch.Tensor, layers: slice, heads: slice) -> bool:
    return (layers.start, layers.stop, heads.start, heads.stop) == (
        0, pool.shape[1], 0, pool.shape[4],
    )  # fmt: skip


def gather_message(
    pool: torch.Tensor,
    block_ids: Sequence[int],
    message: RankMessage,
    first_layer: int,
    flat: torch.Tensor,
) -> None:
    """This (source) rank's slices of the blocks into `flat`, in message order.
    `first_layer`: the model layer the rank's pool starts at."""
    index = torch.tensor(block_ids, dtype=torch.long, device=pool.device)
    for piece, heads, part in _regions(pool, flat, len(block_ids), message, sending=True):
        layers = _layers(piece, first_layer)
        if _whole(pool, layers, heads):
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
    for piece, heads, part in _regions(pool, flat, len(block_ids), message, sending=False):
        layers = _layers(piece, first_layer)
        if _whole(pool, layers, heads):  # as bytes: no CPU index_copy_ for float8
            pool.view(torch.uint8).index_copy_(0, index, part.view(torch.uint8))
        else:
            pool[index, layers, :, :, heads] = part
