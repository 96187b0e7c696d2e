"""Tensor and pipeline parallelism on this machine: decode step time, time per output
token and output tokens/s of one both-role worker in each layout — `tp1` (one process),
`tp2` (`--tensor-parallel-size 2`: gloo all-reduces between two ranks), `pp2`
(`--pipeline-parallel-size 2`: two stages of half the layers, one after the other) — at
concurrency 1 and 16, on the same model and requests, in one run. Layouts alternate
(tp1, tp2, tp1, tp2, ...) because the box drifts. Also the resident memory of each rank
once loaded (weights and pool slices). JSON goes to bench/results/tensor_parallel_cpu.json.

    python -m bench.tensor_parallel [--model llama-150m] [--layouts tp1,tp2,pp2] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import psutil
from transformers import AutoTokenizer

from bench.load_runs import bench_stack, pool_stats, run_loads
from bench.models import BENCH_MODELS, bench_model
from bench.report import machine_info, write_report
from bench.workloads import MixedParams, build_workload, usable_token_ids
from services.stack.launcher import Stack

RESULTS = Path(__file__).resolve().parent / "results"
LOADS = ((1, 4), (16, 32))  # (concurrency, requests)


def rank_memory_mib(stack: Stack) -> dict[str, list[float]]:
    """Memory of rank 0 (the worker process) and of each rank it started: resident (RSS
    counts shared pages in every process that maps them: rank 0 maps its peers' KV pools)
    and proportional (PSS: shared pages split between the processes mapping them)."""
    worker = psutil.Process(next(p for p in stack.processes if p.name.startswith("both-")).pid)
    ranks = [worker, *worker.children()]
    info = [p.memory_full_info() for p in ranks]
    return {
        "rss": [round(i.rss / 2**20, 1) for i in info],
        "pss": [round(i.pss / 2**20, 1) for i in info],
    }


FLAGS = {"tp": "--tensor-parallel-size", "pp": "--pipeline-parallel-size"}


def run_layout(model: Path, layout: str, requests_by_load, kv_cache_memory: str) -> dict:
    """`layout`: "tp<N>" or "pp<N>"."""
    flag, size = FLAGS[layout[:2]], int(layout[2:])
    worker_args = [flag, str(size), "--kv-cache-memory", kv_cache_memory]
    shape = dict(prefill=0, decode=0, both=1)
    with bench_stack(model, {"both": worker_args}, f"bench-{layout}-", **shape) as stack:
        spec = stack.spec
        memory = rank_memory_mib(stack)  # once loaded, before any request
        out = run_loads(
            spec.gateway_address, model, LOADS, requests_by_load, layout,
            lambda: pool_stats(spec.scheduler_address), tp_row,
        )  # fmt: skip
        out["rank_memory_mib"] = memory
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
    parser.add_argument(
        "--layouts", default="tp1,tp2", help="comma-separated: tp<N> and pp<N> (tp1: one rank)"
    )
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--kv-cache-memory", default="1GiB", help="per rank")
    parser.add_argument("--repeats", type=int, default=1, help="runs per size, alternating")
    parser.add_argument("--out", default=str(RESULTS / "tensor_parallel_cpu.json"))
    args = parser.parse_args()
    layouts = args.layouts.split(",")
    for layout in layouts:
        if layout[:2] not in FLAGS or not layout[2:].isdigit():
            parser.error(f"--layouts: {layout!r} is not tp<N> or pp<N>")
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
    runs: dict[str, list] = {layout: [] for layout in layouts}
    for _ in range(args.repeats):
        for layout in layouts:
            runs[layout].append(run_layout(model, layout, requests_by_load, args.kv_cache_memory))
    base = runs[layouts[0]]
    ratios = {
        f"{layout}_over_{layouts[0]}": {
            f"c{c}": {
                "output_tokens_per_s": [
                    round(r[f"c{c}"]["output_tokens_per_s"] / b[f"c{c}"]["output_tokens_per_s"], 3)
                    for b, r in zip(base, runs[layout], strict=True)
                ],
                "tpot_p50": [
                    round(r[f"c{c}"]["tpot_ms"]["p50"] / b[f"c{c}"]["tpot_ms"]["p50"], 3)
                    for b, r in zip(base, runs[layout], strict=True)
                ],
            }
            for c, _ in LOADS
        }
        for layout in layouts[1:]
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
