"""`python -m bench.block_pool`: the scheduler's block pool on its hot path, per operation:
allocate a block (evicting a cached one), cache it, free it, and look up / touch a cached
free block, for a pool with no retained block (every request without `kv_retention_s`),
and for one where a share of the free blocks is retained (issue 45, retention hints).

Pure Python, one core; prints one line per case (ns per block allocated and freed)."""

from __future__ import annotations

import argparse
import random
import time

from services.scheduler.block_pool import BlockPool

BLOCK = 16


def _run(num_blocks: int, rounds: int, retained_share: float, seed: int = 0) -> float:
    """ns per block of one allocate + cache + touch + free cycle, averaged over `rounds`."""
    clock = [1000.0]
    pool = BlockPool(num_blocks, enable_caching=True, **_clock_kwargs(pool_clock=lambda: clock[0]))
    rng = random.Random(seed)
    key = 0
    batch = 8  # a request's worth of blocks
    start = time.perf_counter_ns()
    for _ in range(rounds):
        blocks = pool.allocate(batch)
        for block in blocks:
            key += 1
            pool.cache(block, key, (key,) * BLOCK)
        if retained_share and rng.random() < retained_share:
            _retain(pool, blocks, clock[0] + 60.0)
        pool.decref(reversed(blocks))
        hit = pool.lookup(key - 3, (key - 3,) * BLOCK)
        if hit is not None:
            pool.touch([hit])
            pool.decref([hit])
        clock[0] += 0.01  # 10 ms a step: retained blocks expire as time goes on
    elapsed = time.perf_counter_ns() - start
    pool.check_integrity()
    return elapsed / (rounds * batch)


def _clock_kwargs(pool_clock) -> dict:
    """The pool's clock where it has one (before retention it had none)."""
    try:
        BlockPool(2, clock=pool_clock)
    except TypeError:
        return {}
    return {"clock": pool_clock}


def _retain(pool: BlockPool, blocks: list[int], until: float) -> None:
    retain = getattr(pool, "retain", None)
    if retain is not None:
        retain(blocks, until)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for share in (0.0, 0.25):
        best = min(_run(args.blocks, args.rounds, share) for _ in range(args.repeats))
        print(f"blocks={args.blocks} retained_share={share}: {best:.0f} ns per block cycle")


if __name__ == "__main__":
    main()
