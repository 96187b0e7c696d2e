"""Chained block hashes for automatic prefix caching.

A full block's hash covers its parent's hash and its own token ids, so equal hashes mean
equal prefixes (up to a hash collision, which the block pool rules out by comparing tokens
on every hit). The chain starts from a root that mixes a per-deployment salt and the
request's optional `cache_salt`, its LoRA adapter and its RoPE state, so requests with
different salts, adapters or RoPE states never share blocks (an adapter changes every
layer's K and V; so does the length of a prompt under dynamic or longrope RoPE) and
hashes cannot be predicted across deployments. SHA-256 over a fixed little-endian encoding
(never Python's `hash()`, never pickle). Pure Python.

A request's `ChainOrigin` is what its root mixes besides the salt; the KV events
(`common/kv_events.py`) publish it with a sequence's first block so that a router can
rebuild the chain with a salt of its own.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

BlockHash = bytes  # 32-byte SHA-256 digest


@dataclass(frozen=True)
class ChainOrigin:
    """What a sequence's root mixes besides the deployment salt, as its request says it:
    its `cache_salt`, its adapter's name and its prompt's length (its RoPE key, if any,
    follows from that: `common.rope_config.prompt_rope_key`)."""

    cache_salt: str = ""
    lora_name: str = ""
    num_prompt_tokens: int = 0


def root_hash(
    deployment_salt: bytes, cache_salt: str = "", lora_name: str = "", rope_key: str = ""
) -> BlockHash:
    """The parent of a sequence's first block. `rope_key`: the RoPE state its prompt's KV
    depends on beyond its tokens (`common.rope_config.prompt_rope_key`; "" for most)."""
    digest = hashlib.sha256(b"tandem-prefix-v1\0")
    digest.update(struct.pack("<I", len(deployment_salt)))
    digest.update(deployment_salt)
    salt = cache_salt.encode("utf-8")
    digest.update(struct.pack("<I", len(salt)))
    digest.update(salt)
    if lora_name:  # base-model roots stay as they were
        digest.update(b"lora\0" + lora_name.encode("utf-8"))
    if rope_key:  # (length-dependent RoPE past its threshold only)
        key = rope_key.encode("utf-8")
        digest.update(b"rope\0" + struct.pack("<I", len(key)) + key)
    return digest.digest()


def block_hash(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    digest = hashlib.sha256(parent)
    digest.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return digest.digest()


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, root: BlockHash
) -> list[BlockHash]:
    """Append the hashes of blocks that `token_ids` now fills completely; returns `hashes`."""
    for index in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[index - 1] if index else root
        hashes.append(block_hash(parent, token_ids[index * block_size : (index + 1) * block_size]))
    return hashes
