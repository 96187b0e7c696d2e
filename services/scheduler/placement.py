"""Which worker gets a request: prefix-cache overlap against load. Pure and separately
testable (the routing decision is its own call, as in Dynamo).

Prefill placement minimises the prompt tokens a worker would still have to compute —
its queued tokens plus this prompt's tokens that are not in its prefix cache — so a
worker that already holds the prompt's prefix wins unless it is much busier. Decode
placement minimises the blocks that must cross UCX (blocks the decode pool already holds
are reused) among workers with room, then prefers the most free blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillCandidate:
    queued_tokens: int  # tokens already waiting to be computed on this worker
    cached_tokens: int  # this prompt's tokens found in the worker's prefix cache
    free_blocks: int


@dataclass(frozen=True)
class DecodeCandidate:
    transfer_blocks: int  # blocks that must cross UCX (the rest are reused from its cache)
    consumed_blocks: int  # free blocks taking the request would use up
    free_blocks: int


def choose_prefill(candidates: Sequence[PrefillCandidate], prompt_tokens: int) -> int | None:
    """Index of the worker that would finish this prompt's prefill soonest (None if none)."""
    if not candidates:
        return None
    return min(
        range(len(candidates)),
        key=lambda i: (
            candidates[i].queued_tokens + prompt_tokens - candidates[i].cached_tokens,
            -candidates[i].free_blocks,
            i,
        ),
    )


def choose_decode(candidates: Sequence[DecodeCandidate], reserve: int = 1) -> int | None:
    """Index of the decode worker needing the fewest transferred blocks among those with
    room (plus `reserve` blocks of headroom); None if no worker has room now."""
    fits = [i for i, c in enumerate(candidates) if c.consumed_blocks + reserve <= c.free_blocks]
    if not fits:
        return None
    return min(fits, key=lambda i: (candidates[i].transfer_blocks, -candidates[i].free_blocks, i))
