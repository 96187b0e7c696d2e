"""Tensor parallelism on this machine: decode step time, time per output token and output
tokens/s of one both-role worker with `--tensor-parallel-size 1` and with 2 (each rank a
process; gloo all-reduces between them), at concurrency 1 and 16, on the same model and
requests, in one run. Sizes alternate (1, 2, 1, 2, ...) because the box drifts. Also the
resident memory of each rank once loaded (weights and pool slices). JSON goes to
bench/results/tensor_parallel_cpu.json.

    python -m bench.tensor_parallel [--model llama-150m] [--sizes 1,2] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import psutil
from transformers import AutoTokenizer

from bench.load_runs import pool_stats, run_loads
from bench.models import BENCH_MODELS, bench_model
from bench.report import machine_info, write_report
from bench.workloads import MixedParams, build_workload, usable_token_ids
from services.stack.launcher import Stack, StackSpec

RESULTS = Path(__file__).resolve().parent / "results"
LOADS = ((1, 4), (16, 32))  # (concurrency, requests)


def rank_memory_mib(stack: Stack) -> list[float]:
    """Resident memory of rank 0 (the worker process) and of each rank it started."""
    worker = psutil.Process(next(p for p in stack.processes if p.name.startswith("both-")).pid)
    ranks = [worker, *worker.children()]
    return [round(p.memory_info().rss / 2**20, 1) for p in ranks]


def run_size(model: Path, size: int, requests_by_load, kv_cache_memory: str) -> dict:
    worker_args = ["--tensor-parallel-size", str(size), "--kv-cache-memory", kv_cache_memory]
    spec = StackSpec.on_free_ports(
        str(model), prefill=0, decode=0, both=1, extra_args={"both": worker_args}
    )
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench-tp{size}-"))
    stack = Stack.start(spec, run_dir, ready_timeout_s=300, exit_with_parent=True)
    try:
        rss = rank_memory_mib(stack)  # once loaded, before any request
        out = run_loads(
            spec.gateway_address, model, LOADS, requests_by_load, f"tp{size}",
            lambda: pool_stats(spec.scheduler_address), tp_row,
        )  # fmt: skip
        out["rank_rss_mib"] = rss
    finally:
        stack.stop()
    return out


def tp_row(records, summary, before, after) -> dict:
    return {
        "steps": after.steps - before.steps,
        # the pool's running mean over the worker's life (warm-up included)
        "mean_execute_ms": round(after.mean_execute_ms, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llama-150m", choices=list(BENCH_MODELS))
    parser.add_argument("--sizes", default="1,2", help="tensor-parallel sizes, comma-separated")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--kv-cache-memory", default="1GiB", help="per rank")
    parser.add_argument("--repeats", type=int, default=1, help="runs per size, alternating")
    parser.add_argument("--out", default=str(RESULTS / "tensor_parallel_cpu.json"))
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    model = bench_model(args.model)
    vocab = usable_token_ids(AutoTokenizer.from_pretrained(model))
    shape = dict(
        prompt_len_median=args.prompt_len,
        prompt_len_range=(args.prompt_len, args.prompt_len),
        output_len_range=(args.output_len, args.output_len),
    )
    requests_by_load = [
        build_workload("mixed", vocab, MixedParams(num_requests=n, **shape), seed=c)
        for c, n in LOADS
    ]
    runs: dict[str, list] = {f"tp{s}": [] for s in sizes}
    for _ in range(args.repeats):
        for size in sizes:
            runs[f"tp{size}"].append(run_size(model, size, requests_by_load, args.kv_cache_memory))
    base = runs[f"tp{sizes[0]}"]
    ratios = {
        f"tp{size}_over_tp{sizes[0]}": {
            f"c{c}": {
                "output_tokens_per_s": [
                    round(r[f"c{c}"]["output_tokens_per_s"] / b[f"c{c}"]["output_tokens_per_s"], 3)
                    for b, r in zip(base, runs[f"tp{size}"], strict=True)
                ],
                "tpot_p50": [
                    round(r[f"c{c}"]["tpot_ms"]["p50"] / b[f"c{c}"]["tpot_ms"]["p50"], 3)
                    for b, r in zip(base, runs[f"tp{size}"], strict=True)
                ],
            }
            for c, _ in LOADS
        }
        for size in sizes[1:]
    }
    report = {
        "benchmark": "tensor_parallel",
        "model": args.model,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "kv_cache_memory_per_rank": args.kv_cache_memory,
        "loads": [{"concurrency": c, "requests": n} for c, n in LOADS],
        "runs": runs,
        "ratios": ratios,
        "machine": machine_info(),
    }
    print(json.dumps({"ratios": ratios, "runs": runs}, indent=1))
    print(f"wrote {write_report(args.out, report)}")


if __name__ == "__main__":
    main()
