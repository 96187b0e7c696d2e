"""A step's whole-block copies (swap out, swap in, offload loads, copy-on-write) on a
worker's pools: checked against the pools' sizes, then run in that order before the
forward pass; the offload tier's saves run after it (`run_saves`). Shared by rank 0 and
the peer ranks of a tensor-parallel worker (each on its own slice)."""

from __future__ import annotations

import time

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
    if (moves.offload_in or moves.offload_out or moves.disk_saves or moves.disk_loads) and (
        not offload_blocks
    ):
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


def run_moves(
    moves: BlockMoves,
    kv_cache: KvCache,
    swap_cache: KvCache | None,
    offload_cache: KvCache | None = None,
) -> float:
    """Check, then copy what comes before the forward pass (nothing when the step moves
    no block); returns the seconds its offload loads took."""
    if not moves:
        return 0.0
    check_moves(moves, kv_cache, swap_cache, offload_cache)
    if moves.swap_out:
        swap_cache.copy_blocks(moves.swap_out, source=kv_cache)
    if moves.swap_in:
        kv_cache.copy_blocks(moves.swap_in, source=swap_cache)
    offload_s = 0.0
    if moves.offload_in:
        started = time.perf_counter()
        kv_cache.copy_blocks(moves.offload_in, source=offload_cache)
        offload_s = time.perf_counter() - started
    kv_cache.copy_blocks(moves.copies)
    return offload_s


def run_saves(moves: BlockMoves, kv_cache: KvCache, offload_cache: KvCache | None) -> None:
    """After the forward pass: save the blocks it filled into the offload tier (checked
    with the rest by `run_moves`)."""
    if moves.offload_out:
        offload_cache.copy_blocks(moves.offload_out, source=kv_cache)
