"""Retention hints (issue 45, `kv_retention_s`): when a request that asked for retention
finishes, the blocks holding its prompt and output are kept until now + its retention, in
each tier the scheduler manages — the device pool's prefix cache and the host tier (both
`BlockPool.retain`) — and, through the host tier's disk saves, on disk
(`HostOffload._demote` sends the deadline with the block). A later request extends a
deadline only when it asks for retention itself (the later deadline wins). Pure Python.
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
