"""Retention hints (issue 45, `kv_retention_s`): when a request that asked for retention
finishes, the blocks holding its prompt and output are kept until now + its retention, in
each tier the scheduler manages — the device pool's prefix cache and the host tier (both
`BlockPool.retain`) — and on disk: through the host tier's disk saves
(`HostOffload._demote` sends the deadline with the block) and, for blocks only the disk
holds when it finishes, with the pool's next plan (`HostOffload.retain`). A later request
extends a deadline only when it asks for retention itself (the later deadline wins).

`retain_finished` keeps a request of the pool (its table); `retain_sequence` keeps a
sequence that is no request of the pool, found by its block hashes as a prefix-cache hit
would find it: a beam search's returned hypotheses, whose blocks belonged to beams
released along the way (`BeamDriver`). Pure Python.
"""

from __future__ import annotations

from services.scheduler.block_manager import BlockManager
from services.scheduler.kv_offload import HostOffload
from services.scheduler.request import Request


def retain_finished(blocks: BlockManager, offload: HostOffload | None, request: Request) -> float:
    """Mark a finished request's blocks retained (before they are freed); returns the
    deadline (0: it asked for none)."""
    if request.kv_retention_s <= 0:
        return 0.0
    until = blocks.pool.clock() + request.kv_retention_s
    blocks.retain(request.request_id, until)
    if offload is not None:
        offload.retain(request, until)
    return until


def retain_sequence(blocks: BlockManager, offload: HostOffload | None, sequence: Request) -> float:
    """Mark retained the full blocks of `sequence`'s first `num_computed_tokens` tokens
    that the tiers hold: on the device the longest cached run from its start (held or
    free), in the host tier and on disk each block found (`HostOffload.retain`).
    `sequence` is a request never submitted to this pool, with its tokens, its hash root
    and its `kv_retention_s`; returns the deadline (0: none asked)."""
    if sequence.kv_retention_s <= 0:
        return 0.0
    until = blocks.pool.clock() + sequence.kv_retention_s
    sequence.update_block_hashes(blocks.block_size)
    found = blocks.cached_prefix(
        sequence.block_hashes, sequence.all_token_ids, sequence.num_computed_tokens
    )
    blocks.pool.retain((b for b in found if not blocks.is_null(b)), until)
    if offload is not None:
        offload.retain(sequence, until)
    return until
