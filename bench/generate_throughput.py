"""Tokens/s of Tandem's Generate vs HF `generate` on the same prompts, side by side.

Starts the whole stack (gateway, scheduler, prefill + decode workers as processes) on free
loopback ports unless --address points at a running one, then measures one stream and N
concurrent streams of greedy decoding with a fixed output length, and HF `generate` on the
same prompt ids (one at a time, and as one padded batch of N). Prints a table and writes
JSON to bench/results/.

    python -m bench.generate_throughput [--model DIR] [--concurrency 8] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from common.pb.tandem.v1 import generate_pb2, generate_pb2_grpc

RESULTS = Path(__file__).resolve().parent / "results"
PROMPTS = [
    "Once upon a time",
    "The scheduler decides which requests run in the next step",
    "Paged attention keeps keys and values in fixed-size blocks",
    "In a distant galaxy",
    "KV blocks travel from prefill to decode workers over UCX",
    "The quick brown fox",
    "Continuous batching lets new requests join at every step",
    "Tokens per second is what users feel",
]


@dataclass
class StreamStats:
    tokens: int
    seconds: float
    ttft_s: float
    itls_s: list[float]


def one_stream(address: str, prompt_ids: list[int], max_tokens: int) -> StreamStats:
    request = generate_pb2.GenerateRequest(max_tokens=max_tokens)
    request.token_ids.ids.extend(prompt_ids)
    request.sampling.temperature = 0.0
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        start = time.perf_counter()
        arrivals, tokens = [], 0
        for response in stub.Generate(request, timeout=600):
            if response.token_ids:
                arrivals.append(time.perf_counter())
                tokens += len(response.token_ids)
    itls = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return StreamStats(tokens, arrivals[-1] - start, arrivals[0] - start, itls)


def run_tandem(address: str, prompts: list[list[int]], max_tokens: int) -> dict:
    results: list[StreamStats | None] = [None] * len(prompts)
    barrier = threading.Barrier(len(prompts))

    def worker(i: int) -> None:
        barrier.wait()
        results[i] = one_stream(address, prompts[i], max_tokens)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    tokens = sum(r.tokens for r in results)
    itls = [x for r in results for x in r.itls_s]
    return {
        "streams": len(prompts),
        "output_tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "per_stream_tokens_per_s": round(statistics.mean(r.tokens / r.seconds for r in results), 1),
        "ttft_ms_mean": round(statistics.mean(r.ttft_s for r in results) * 1e3, 1),
        "itl_ms_mean": round(statistics.mean(itls) * 1e3, 2) if itls else None,
        "itl_ms_p90": (
            round(statistics.quantiles(itls, n=10)[-1] * 1e3, 2) if len(itls) > 1 else None
        ),
    }


def step_overheads(scheduler_address: str) -> list[dict]:
    """Per worker: steps run, mean model time, mean time between step results."""
    from common.pb.tandem.internal.v1 import scheduler_pb2, scheduler_pb2_grpc

    with grpc.insecure_channel(scheduler_address) as channel:
        stats = scheduler_pb2_grpc.SchedulerServiceStub(channel).GetPoolStats(
            scheduler_pb2.GetPoolStatsRequest(), timeout=10
        )
    return [
        {
            "worker": p.worker_id,
            "steps": p.steps,
            "mean_execute_ms": round(p.mean_execute_ms, 3),
            "mean_step_interval_ms": round(p.mean_step_interval_ms, 3),
            "overhead_ms": round(p.mean_step_overhead_ms, 3),
        }
        for p in stats.pools
    ]


def median_run(measure, repeat: int) -> dict:
    """Run `measure()` `repeat` times; keep the run with the median tokens/s."""
    runs = sorted((measure() for _ in range(repeat)), key=lambda r: r["tokens_per_s"])
    best = dict(runs[len(runs) // 2])
    best["tokens_per_s_all_runs"] = [r["tokens_per_s"] for r in runs]
    return best


@torch.inference_mode()
def run_hf(model, prompts: list[list[int]], max_tokens: int, batched: bool) -> dict:
    kwargs = dict(
        do_sample=False,
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        pad_token_id=model.generation_config.eos_token_id,
    )
    start = time.perf_counter()
    tokens = 0
    if batched:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = model.generate(ids, attention_mask=mask, **kwargs)
        tokens = (out.shape[1] - width) * len(prompts)
    else:
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            tokens += out.shape[1] - len(p)
    wall = time.perf_counter() - start
    return {
        "streams": len(prompts),
        "batched": batched,
        "output_tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="", help="model folder (default: embedded model)")
    parser.add_argument("--address", default="", help="use a running gateway instead")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (median)")
    parser.add_argument("--out", default="", help="JSON path (default bench/results/...)")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from devtools.checkpoint_builder import build_default_model
    from services.stack.launcher import Stack, StackSpec

    model = args.model or str(
        build_default_model(
            Path(__file__).resolve().parents[1] / ".tandem" / "models" / "tandem-tiny-llama"
        )
    )
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(args.concurrency)]
    stack = None
    address = args.address
    if not address:
        stack = Stack.start(
            StackSpec.on_free_ports(model),
            tempfile.mkdtemp(prefix="bench-"),
            exit_with_parent=True,
        )
        address = stack.spec.gateway_address
    try:
        one_stream(address, prompts[0], 8)  # warm-up (first UCX endpoint, allocator)
        tandem_single = median_run(
            lambda: run_tandem(address, prompts[:1], args.max_tokens), args.repeat
        )
        tandem_multi = median_run(
            lambda: run_tandem(address, prompts, args.max_tokens), args.repeat
        )
        steps = step_overheads(stack.spec.scheduler_address) if stack is not None else []
    finally:
        if stack is not None:
            stack.stop()
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    hf_single = median_run(
        lambda: run_hf(hf, prompts[:1], args.max_tokens, batched=False), args.repeat
    )
    hf_multi = median_run(lambda: run_hf(hf, prompts, args.max_tokens, batched=True), args.repeat)
    report = {
        "benchmark": "generate_throughput",
        "model": Path(model).name,
        "max_tokens": args.max_tokens,
        "repeat": args.repeat,
        "note": "Tandem: 4 processes (gateway, scheduler, prefill, decode) over gRPC + UCX on "
        "loopback, greedy; HF: transformers generate in one process, fp32, same prompt ids "
        "(the 8 as one left-padded batch), min_new_tokens=max_tokens.",
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
        },
        "tandem": {"single": tandem_single, f"concurrent_{args.concurrency}": tandem_multi},
        "scheduler_step_overhead": steps,
        "async_scheduling": os.environ.get("TANDEM_ASYNC_SCHEDULING", "true"),
        "hf_generate": {"single": hf_single, f"batch_{args.concurrency}": hf_multi},
        "ratio_tandem_over_hf": {
            "single": round(tandem_single["tokens_per_s"] / hf_single["tokens_per_s"], 2),
            f"concurrent_{args.concurrency}": round(
                tandem_multi["tokens_per_s"] / hf_multi["tokens_per_s"], 2
            ),
        },
    }
    print(json.dumps(report, indent=2))
    RESULTS.mkdir(exist_ok=True)
    out = Path(args.out) if args.out else RESULTS / f"generate_throughput_{Path(model).name}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
