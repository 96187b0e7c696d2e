"""Layer-wise KV streaming: how long after the prefill worker finishes a prompt's last
layer its KV is in place on the decode worker, streamed (the transfer starts when the
prompt's last chunk is scheduled and copies each layer as it is written) vs after the
prompt (the transfer starts when the prefill step's result reaches the scheduler).

Runs the real stack (1 prefill + 1 decode worker, same host: the shared-memory pull) on a
12-layer model with 2,048-token prompts, alternating the modes (`--repeats` runs each),
and reads the decode pool's
`mean_kv_source_lag_ms` (prefill's last layer done -> blocks in place, measured by the
decode worker on the host's monotonic clock), the time to first token and from the first
token to the second (the decode worker's first step waits for the KV). Also reported:
one layer's compute (the prefill step's time / layers) and one layer's transfer (a
layer's bytes of the prompt's blocks at the pull's measured bandwidth), the yardstick the
streamed gap is held to. JSON goes to bench/results/kv_stream_cpu.json.

With `--max-num-batched-tokens` below the prompt length, prompts come in chunks: streamed,
each chunk's blocks are copied as that chunk completes (the transfer starts with the first
chunk), so only the last chunk's blocks are left at the end.

    python -m bench.kv_stream [--prompt-len 2048] [--requests 4] [--repeats 2]
                              [--max-num-batched-tokens 512] [--out ...]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from bench.models import bench_model
from bench.report import machine_info, write_report
from common.pb.tandem.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from common.pb.tandem.v1 import generate_pb2, generate_pb2_grpc
from services.stack.launcher import Stack, StackSpec

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "llama-150m-4k"


def pool_stats(address: str) -> scheduler_pb2.GetPoolStatsResponse:
    with grpc.insecure_channel(address) as channel:
        return scheduler_pb2_grpc.SchedulerServiceStub(channel).GetPoolStats(
            scheduler_pb2.GetPoolStatsRequest(), timeout=10
        )


def token_times(address: str, prompt: list[int]) -> tuple[float, float]:
    """(time to the first token, first to second token) of a 2-token greedy request."""
    request = generate_pb2.GenerateRequest(max_tokens=2)
    request.token_ids.ids.extend(prompt)
    request.sampling.temperature = 0.0
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        start, arrivals = time.perf_counter(), []
        for response in stub.Generate(request, timeout=300):  # to the end: no abort
            arrivals.extend([time.perf_counter() - start] * len(response.token_ids))
    if len(arrivals) < 2:
        raise RuntimeError(f"{len(arrivals)} tokens came back, not 2")
    return arrivals[0], arrivals[1] - arrivals[0]


def run_mode(
    model: Path, streaming: bool, prompts: list[list[int]], max_len: int, chunk: int
) -> dict:
    spec = StackSpec.on_free_ports(
        str(model),
        extra_args={
            "scheduler": [
                "--kv-transfer-streaming",
                "true" if streaming else "false",
                "--max-num-batched-tokens",
                str(chunk),
            ],
            "prefill": ["--max-model-len", str(max_len)],
            "decode": ["--max-model-len", str(max_len)],
        },
    )
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench-kv-stream-{streaming}-"))
    stack = Stack.start(spec, run_dir, ready_timeout_s=300, exit_with_parent=True)
    try:
        token_times(spec.gateway_address, prompts[0])  # warm up (not counted)
        before = pool_stats(spec.scheduler_address)
        times = [token_times(spec.gateway_address, p) for p in prompts[1:]]
        ttfts = [t[0] for t in times]
        after = pool_stats(spec.scheduler_address)
    finally:
        stack.stop()
    decode = next(p for p in after.pools if p.role == 2)  # WORKER_ROLE_DECODE
    prefill = next(p for p in after.pools if p.role == 1)
    decode_before = next(p for p in before.pools if p.role == 2)
    prefill_before = next(p for p in before.pools if p.role == 1)
    transfers = decode.kv_transfers - decode_before.kv_transfers
    lag_total = decode.kv_source_lag_ms_total - decode_before.kv_source_lag_ms_total
    execute_total = (  # a request's prompt steps (the rest only drop requests)
        prefill.mean_execute_ms * prefill.steps
        - prefill_before.mean_execute_ms * prefill_before.steps
    )
    return {
        "streaming": streaming,
        "requests": len(ttfts),
        "transfers": transfers,
        "mean_source_lag_ms": round(lag_total / max(1, transfers), 3),
        "ttft_p50_ms": round(statistics.median(ttfts) * 1e3, 1),
        "first_to_second_token_p50_ms": round(statistics.median(t[1] for t in times) * 1e3, 1),
        "prefill_step_ms": round(execute_total / len(ttfts), 1),
    }


def merge(runs: list[dict]) -> dict:
    """One mode's runs: every number as a list over runs, plus the median."""
    out = {"streaming": runs[0]["streaming"], "runs": len(runs)}
    for key in runs[0]:
        if key != "streaming":
            values = [r[key] for r in runs]
            out[key] = round(statistics.median(values), 3)
            out[f"{key}_runs"] = values
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--requests", type=int, default=4, help="timed requests per run")
    parser.add_argument("--repeats", type=int, default=2, help="runs per mode, alternating")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="the scheduler's token budget per step: below the prompt length, prompts come "
        "in chunks (default: the whole prompt in one step)",
    )
    parser.add_argument(
        "--pull-gbps",
        type=float,
        default=None,
        help="the pull's bandwidth for the per-layer transfer yardstick "
        "(default: from bench/results/kv_transfer_cpu.json, 64 MiB row)",
    )
    parser.add_argument("--out", default=str(RESULTS / "kv_stream_cpu.json"))
    args = parser.parse_args()
    model = bench_model(MODEL)
    config = json.loads((model / "config.json").read_text())
    layers = config["num_hidden_layers"]
    kv_heads = config["num_key_value_heads"]
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    rng = random.Random(0)
    vocab = config["vocab_size"]
    prompts = [
        [rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(args.requests + 1)
    ]
    max_len = args.prompt_len + 16
    chunk = args.max_num_batched_tokens or max_len
    # Modes alternate (after, streamed, after, ...): the box drifts between runs.
    runs = [
        run_mode(model, streaming, prompts, max_len, chunk)
        for _ in range(args.repeats)
        for streaming in (False, True)
    ]
    modes = [merge([r for r in runs if r["streaming"] is streaming]) for streaming in (False, True)]
    pull_gbps = args.pull_gbps
    if pull_gbps is None:
        rows = json.loads((RESULTS / "kv_transfer_cpu.json").read_text())["rows"]
        pull_gbps = max(rows, key=lambda r: r["bytes"])["shared_memory_pull_gbps"]
    # K and V, fp32, of what is left to copy at the end: the last chunk's tokens when
    # streamed in parts (every token before per-chunk streaming)
    layer_bytes = 2 * min(chunk, args.prompt_len) * kv_heads * head_dim * 4
    num_chunks = -(-args.prompt_len // chunk)
    compute_ms = modes[1]["prefill_step_ms"] / num_chunks / layers  # per step
    report = {
        "benchmark": "kv_stream",
        "model": MODEL,
        "num_layers": layers,
        "prompt_len": args.prompt_len,
        "max_num_batched_tokens": chunk,
        "prompt_steps": num_chunks,
        "one_layer_compute_ms": round(compute_ms, 2),
        "one_layer_bytes": layer_bytes,
        "one_layer_transfer_ms": round(layer_bytes / (pull_gbps * 1e9) * 1e3, 3),
        "pull_gbps_used": pull_gbps,
        "after_prompt": modes[0],
        "streamed": modes[1],
        "machine": machine_info(),
    }
    print(json.dumps(report, indent=2))
    print(f"wrote {write_report(args.out, report)}")


if __name__ == "__main__":
    main()
