"""Runs a function as every rank of a `torch.distributed` group, one spawned process per
rank, for the model-level parallel tests: `target(rank, *args, out)` puts one result on
`out`; the results come back sorted (rank first), and every process must exit cleanly."""

from __future__ import annotations

import multiprocessing


def run_ranks(target, world_size: int, args: tuple, timeout_s: float = 120.0) -> list:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, out)) for r in range(world_size)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=timeout_s) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return results
