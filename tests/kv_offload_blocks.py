"""Shared makings of the kv_offload tests: real prefix hashes, real block tensors."""

from __future__ import annotations

import torch

from common.prefix_hash import block_hash, root_hash
from services.worker.kv_offload.keys import BlockKey, TierIdentity

ROOT = root_hash(b"deployment-a")
OTHER_ROOT = root_hash(b"deployment-a", cache_salt="tenant-b")
# A block of 2 slots, 4 tokens, 2 KV heads of 8, K and V, float32: 1 KiB.
SHAPE = (2, 2, 4, 2, 8)
BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 4


def key(index: int, group: int = 0, root: bytes = ROOT) -> BlockKey:
    return BlockKey(block_hash(root, [index, index + 1, index + 2, index + 3]), group)


def block(index: int, nbytes: int = BLOCK_BYTES) -> torch.Tensor:
    """A block's bytes that differ per index (uint8 `[nbytes]`)."""
    return ((torch.arange(nbytes, dtype=torch.int64) * (2 * index + 1) + index) % 256).to(
        torch.uint8
    )


def identity(**changes) -> TierIdentity:
    fields = dict(model="tiny-llama@abc", num_slots=2, block_size=4, block_bytes=BLOCK_BYTES)
    fields["dtype"] = "torch.float32"
    fields.update(changes)
    return TierIdentity(**fields)
