"""A step's whole-block copies within a worker (swap out, swap in, copy-on-write), checked
with every other move of the plan against the pools' sizes (`check_moves`). The offload
tier's loads and saves are its connector's (`kv_offload_connector`), run between the swaps
and the copies. Shared by rank 0 and the peer ranks of a parallel worker (each on its own
slice)."""

from __future__ import annotations

from common.step_plan import BlockMoves
from services.worker.batch import PlanError
from services.worker.kv_cache import KvCache


def check_moves(
    moves: BlockMoves,
    kv_cache: KvCache,
    swap_cache: KvCache | None,
    offload_cache: KvCache | None = None,
) -> None:
    swap_blocks = 0 if swap_cache is None else swap_cache.num_blocks
    offload_blocks = 0 if offload_cache is None else offload_cache.num_blocks
    tier_moves = moves.offload_in or moves.offload_out or moves.disk_saves or moves.disk_loads
    if (tier_moves or moves.disk_retains) and not offload_blocks:
        raise PlanError("the plan moves offload blocks but this worker has no offload tier")
    if (moves.swap_out or moves.swap_in) and not swap_blocks:
        raise PlanError("the plan swaps blocks but this worker has no swap space")
    for name, pairs, (src_n, dst_n) in (
        ("swap_out", moves.swap_out, (kv_cache.num_blocks, swap_blocks)),
        ("swap_in", moves.swap_in, (swap_blocks, kv_cache.num_blocks)),
        ("block_copies", moves.copies, (kv_cache.num_blocks,) * 2),
        ("offload_in", moves.offload_in, (offload_blocks, kv_cache.num_blocks)),
        ("offload_out", moves.offload_out, (kv_cache.num_blocks, offload_blocks)),
        ("disk_saves", [(b.offload_block, 0) for b in moves.disk_saves], (offload_blocks, 1)),
        ("disk_loads", [(0, b.offload_block) for b in moves.disk_loads], (1, offload_blocks)),
    ):
        bad = [p for p in pairs if not (0 <= p[0] < src_n and 0 <= p[1] < dst_n)]
        if bad:
            raise PlanError(f"{name} pairs {bad[:4]} are outside the pools")


def run_swaps(moves: BlockMoves, kv_cache: KvCache, swap_cache: KvCache | None) -> None:
    """Before the forward pass, first: preempted requests' blocks out to the swap space,
    resumed ones' back in (checked by `check_moves`)."""
    if moves.swap_out:
        swap_cache.copy_blocks(moves.swap_out, source=kv_cache)
    if moves.swap_in:
        kv_cache.copy_blocks(moves.swap_in, source=swap_cache)


def run_copies(moves: BlockMoves, kv_cache: KvCache) -> None:
    """Before the forward pass, last (after the connectors' loads, which may fill a copy's
    source): copy-on-write copies."""
    if moves.copies:
        kv_cache.copy_blocks(moves.copies)
