"""Latency of one gloo all-reduce between two processes on this host, for the shapes a
tensor-parallel CPU worker reduces (a decode row, a 16-row batch, a vocabulary row): the
price of each of its two all-reduces per layer. JSON goes to
bench/results/gloo_latency_cpu.json.

    python -m bench.gloo_latency
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.report import machine_info, write_report

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = ((1, 1024), (16, 1024), (1, 32000))
CALLS = 300


def _rank(rank: int, world: int, store: str, out) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    for shape in SHAPES:
        x = torch.randn(*shape)
        for _ in range(20):
            dist.all_reduce(x)
        started = time.perf_counter()
        for _ in range(CALLS):
            dist.all_reduce(x)
        if rank == 0:
            out.put((shape, (time.perf_counter() - started) / CALLS * 1e6))
    dist.destroy_process_group()


def main() -> None:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(2, f"{tmp}/store", out), nprocs=2, start_method="spawn")
    rows = [out.get(timeout=5) for _ in SHAPES]
    for shape, micros in rows:
        print(f"{shape}: {micros:.0f} us per all_reduce")
    report = {
        "benchmark": "gloo_latency",
        "world_size": 2,
        "calls": CALLS,
        "us_per_all_reduce": {"x".join(map(str, s)): round(m, 1) for s, m in rows},
        "machine": machine_info(),
    }
    print(f"wrote {write_report(RESULTS / 'gloo_latency_cpu.json', report)}")


if __name__ == "__main__":
    main()
