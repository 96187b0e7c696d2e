"""How a KV transfer between workers of different parallel layouts travels over UCX: one
tagged message per (source rank, destination rank) pair that `kv_transfer_plan` connects,
sent by the source rank's own UCX worker straight to the destination rank's. A message
holds the pair's slices in plan order, each `[blocks, layers, 2, slot, heads, dim]` of the
transfer's blocks (a whole-pool slice is therefore a plain block gather). Pure Python.

Tags: a destination rank may receive from several source ranks at once, so each source
rank's messages carry their own tag (`rank_tag`). Rank 0's is the transfer's tag itself, so
a transfer between two one-process workers is the single message it always was.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from common.parallel_plan import KvSlice

# The scheduler's transfer tags leave the top bit clear; derived ones set it.
DERIVED_TAG_BIT = 1 << 63


@dataclass(frozen=True)
class RankMessage:
    src_rank: int
    dst_rank: int
    pieces: tuple[KvSlice, ...]

    def nbytes(self, num_blocks: int, block_size: int, head_dim: int, itemsize: int) -> int:
        """This message's bytes for a transfer of `num_blocks` blocks."""
        return num_blocks * sum(
            len(p.layers) * 2 * block_size * len(p.heads) * head_dim * itemsize for p in self.pieces
        )


def rank_messages(plan: Iterable[KvSlice]) -> list[RankMessage]:
    """The plan's slices grouped by (source rank, destination rank), pairs in the order
    they first appear and slices in plan order within each."""
    grouped: dict[tuple[int, int], list[KvSlice]] = {}
    for piece in plan:
        grouped.setdefault((piece.src_rank, piece.dst_rank), []).append(piece)
    return [RankMessage(s, d, tuple(pieces)) for (s, d), pieces in grouped.items()]


def rank_tag(tag: int, src_rank: int) -> int:
    """The UCX tag of source rank `src_rank`'s messages of transfer `tag`."""
    if not 0 <= tag < DERIVED_TAG_BIT:
        raise ValueError(f"transfer tag {tag:#x} must leave the top bit clear")
    if src_rank == 0:
        return tag
    digest = hashlib.blake2b(struct.pack(">QI", tag, src_rank), digest_size=8).digest()
    return int.from_bytes(digest, "big") | DERIVED_TAG_BIT


def slices_to_wire(pieces: Sequence[KvSlice]) -> list[list[int]]:
    """JSON-ready slices (for the pipe from rank 0 to its other ranks)."""
    return [
        [p.src_rank, p.dst_rank, p.layers.start, p.layers.stop, p.heads.start, p.heads.stop,
         p.src_head, p.dst_head]
        for p in pieces
    ]  # fmt: skip


def slices_from_wire(rows: Sequence[Sequence[int]]) -> tuple[KvSlice, ...]:
    out = []
    for row in rows:
        if len(row) != 8 or not all(isinstance(v, int) and v >= 0 for v in row):
            raise ValueError(f"bad KV slice {row!r}")
        s, d, l0, l1, h0, h1, sh, dh = row
        out.append(KvSlice(s, d, range(l0, l1), range(h0, h1), sh, dh))
    return tuple(out)
