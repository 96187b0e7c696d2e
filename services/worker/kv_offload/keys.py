"""What names a block in the offload tiers, what makes a tier's file foreign, and what a
tier reports when a block leaves it.

- `BlockKey`: a full block's chained hash (`common.prefix_hash`, 32 bytes of SHA-256) and
  its KV group (`common.kv_groups`; 0 for most models).
- `TierIdentity`: the model and geometry a block's bytes mean something for (slots per
  block, block size, bytes per block, dtype, this worker's TP rank/size and PP stage). Its
  `fingerprint` goes into every disk file's header: a file of another geometry, model or
  rank is foreign, a miss.
- `Evicted`: a block that left the disk tier (LRU eviction, or dropped as corrupt or
  foreign), so the caller can tell the scheduler's index (and its KV events).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import torch

HASH_BYTES = 32  # SHA-256, as common.prefix_hash makes them
MAX_GROUP = 2**32 - 1  # the disk header keeps the group in 4 bytes


@dataclass(frozen=True, order=True)
class BlockKey:
    """One block of one KV group, named by its chained prefix hash."""

    block_hash: bytes
    group: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.block_hash, bytes) or len(self.block_hash) != HASH_BYTES:
            raise ValueError(f"a block hash is {HASH_BYTES} bytes, got {self.block_hash!r}")
        if isinstance(self.group, bool) or not isinstance(self.group, int):
            raise ValueError(f"a KV group is an int, got {self.group!r}")
        if not 0 <= self.group <= MAX_GROUP:
            raise ValueError(f"KV group {self.group} out of range [0, {MAX_GROUP}]")


def check_root(root: bytes) -> bytes:
    """A salted root (`common.prefix_hash.root_hash`): 32 bytes."""
    if not isinstance(root, bytes) or len(root) != HASH_BYTES:
        raise ValueError(f"a salted root is {HASH_BYTES} bytes, got {root!r}")
    return root


@dataclass(frozen=True)
class TierIdentity:
    """The worker a tier's blocks belong to. `model`: a stable name of the weights the KV
    was computed with (e.g. the checkpoint's folder name and revision, or a hash of its
    config): stable across restarts, or the disk tier never hits after one. `num_slots`:
    layers (slots) per block of this stage; `block_bytes`: one block's bytes, all slots,
    K and V; `dtype`: the KV cache dtype (`str(torch.dtype)` or a name)."""

    model: str
    num_slots: int
    block_size: int
    block_bytes: int
    dtype: str
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.dtype, torch.dtype):
            object.__setattr__(self, "dtype", str(self.dtype))
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("a tier identity needs the model's name")
        if not isinstance(self.dtype, str) or not self.dtype:
            raise ValueError(f"a tier identity needs the KV dtype, got {self.dtype!r}")
        for name in ("num_slots", "block_size", "block_bytes", "tp_size", "pp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"tier identity {name} must be a positive int, got {value!r}")
        for name, size in (("tp_rank", self.tp_size), ("pp_rank", self.pp_size)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
                raise ValueError(f"tier identity {name} must be in [0, {size}), got {value!r}")

    @property
    def fingerprint(self) -> bytes:
        """SHA-256 of a fixed encoding of every field (sorted-key JSON: no pickle, no
        Python `hash()`), 32 bytes."""
        text = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(b"tandem-kv-tier-v1\0" + text.encode("utf-8")).digest()


@dataclass(frozen=True)
class Evicted:
    """A block that left the disk tier. `reason`: "lru" (pushed out by a put, or by the
    budget at start), else why it was dropped ("foreign", "checksum mismatch",
    "truncated", ...). `nbytes`: what it freed (its file: header and block)."""

    key: BlockKey
    nbytes: int
    reason: str = "lru"
