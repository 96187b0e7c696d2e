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
import uuid
from pathlib import Path

import grpc
import psutil
from transformers import AutoTokenizer

from bench.metrics import summarize
from bench.models import BENCH_MODELS, bench_model
from bench.report import load_average, machine_info, write_report
from bench.serve_client import run_client, warm_up
from bench.workloads import MixedParams, build_workload, usable_token_ids
from common.pb.tandem.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.stack.launcher import Stack, StackSpec

RESULTS = Path(__file__).resolve().parent / "results"
LOADS = ((1, 4), (16, 32))  # (concurrency, requests)


def pool(address: str):
    with grpc.insecure_channel(address) as channel:
        stats = scheduler_pb2_grpc.SchedulerServiceStub(channel).GetPoolStats(
            scheduler_pb2.GetPoolStatsRequest(), timeout=10
        )
    (only,) = stats.pools
    return only


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
    out: dict = {"rank_rss_mib": rank_memory_mib(stack)}
    try:
        vocab = usable_token_ids(AutoTokenizer.from_pretrained(model))
        warm_up(spec.gateway_address, vocab)
        for (concurrency, _), requests in zip(LOADS, requests_by_load, strict=True):
            before = pool(spec.scheduler_address)
            load = load_average()
            records, wall = run_client(
                spec.gateway_address,
                requests,
                None,
                concurrency,
                f"bench-tp-{uuid.uuid4().hex}",
                label=f"tp{size} c{concurrency}",
                show_progress=False,
            )
            after = pool(spec.scheduler_address)
            summary = summarize(records, wall)
            steps = after.steps - before.steps
            out[f"c{concurrency}"] = {
                "output_tokens_per_s": summary["output_tokens_per_s"],
                "tpot_ms": summary["tpot_ms"],
                "ttft_ms": summary["ttft_ms"],
                "completed": summary["completed"],
                "steps": steps,
                # the pool's running mean over the worker's life (warm-up included)
                "mean_execute_ms": round(after.mean_execute_ms, 3),
                "load_avg_1m_before": load,
            }
    finally:
        stack.stop()
    return out


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
