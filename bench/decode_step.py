"""One decode step of a model on its own (no services, no sampler): B sequences of L cached
tokens each, the logits of their next token, for each CPU GEMM format (`--cpu-gemm`),
interleaved so that a slow spell of the shared box lands on every format alike. Then a
torch-profiler table of one format's step: which ops take the time.

The model is loaded once per format (each with its own packed weights); the KV blocks of
each sequence are scattered over the pool as a long-running server's are. Prints a table
(median and min ms per step) and writes JSON to bench/results/decode_step.json.

    python -m bench.decode_step [--model .tandem/models/llama-32m] [--batches 1,16,32]
        [--formats onednn,tandem] [--context 192] [--profile tandem]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from bench.report import load_average, machine_info
from services.worker.kv_cache import KvCache
from services.worker.models.attention_metadata import SequenceSlice, build_attention_metadata
from services.worker.models.weight_loader import load_model

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK = 16


def _step_inputs(config, batch: int, context: int):
    per_seq = -(-(context + 1) // BLOCK)
    cache = KvCache(
        batch * per_seq + 1,
        BLOCK,
        config.num_hidden_layers,
        config.num_key_value_heads,
        config.head_dim,
        torch.float32,
    )
    blocks = list(range(batch * per_seq))
    random.Random(0).shuffle(blocks)
    slices = [
        SequenceSlice(context, 1, blocks[i * per_seq : (i + 1) * per_seq]) for i in range(batch)
    ]
    positions, meta = build_attention_metadata(slices, BLOCK, torch.device("cpu"))
    ids = torch.randint(0, config.vocab_size, (batch,), generator=torch.Generator().manual_seed(0))
    return ids, positions, cache, meta


def _step(model, inputs) -> None:
    ids, positions, cache, meta = inputs
    model.compute_logits(model(ids, positions, cache, meta))


@torch.inference_mode()
def time_steps(models: dict, inputs, rounds: int, steps: int) -> dict[str, dict[str, float]]:
    """Median and min over rounds of each format's median step (ms); formats alternate."""
    for model in models.values():
        _step(model, inputs)  # warm-up: oneDNN builds its kernels, caches fill
    medians: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                _step(model, inputs)
                times.append(time.perf_counter() - start)
            medians[name].append(statistics.median(times) * 1e3)
    return {
        name: {"median_ms": round(statistics.median(v), 2), "min_ms": round(min(v), 2)}
        for name, v in medians.items()
    }


@torch.inference_mode()
def profile_ops(model, inputs, steps: int = 20, top: int = 12) -> list[dict]:
    """The ops taking most self CPU time, per step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            _step(model, inputs)
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in rows)
    return [
        {
            "op": e.key,
            "ms_per_step": round(e.self_cpu_time_total / 1e3 / steps, 3),
            "share": round(e.self_cpu_time_total / total, 3),
            "calls_per_step": e.count // steps,
        }
        for e in rows[:top]
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=".tandem/models/llama-32m")
    parser.add_argument("--batches", default="1,16,32")
    parser.add_argument("--formats", default="onednn,tandem")
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--profile", default="", help="format to profile at the largest batch")
    parser.add_argument("--out", default=str(RESULTS / "decode_step.json"))
    args = parser.parse_args()
    formats = [f for f in args.formats.split(",") if f]
    models = {}
    for fmt in formats:
        model, config = load_model(args.model, dtype=torch.float32)
        model.pack_weights(fmt)
        models[fmt] = model
    result = {
        "machine": machine_info(),
        "load_average_before": load_average(),
        "model": args.model,
        "context": args.context,
        "torch_threads": torch.get_num_threads(),
        "steps": {},
    }
    batches = [int(b) for b in args.batches.split(",")]
    for batch in batches:
        inputs = _step_inputs(config, batch, args.context)
        cells = time_steps(models, inputs, args.rounds, args.steps)
        result["steps"][str(batch)] = cells
        line = "  ".join(f"{n} {c['median_ms']:7.2f} ({c['min_ms']:.2f})" for n, c in cells.items())
        print(f"B={batch:<3} L={args.context}: {line}  ms median (min)", flush=True)
    if args.profile:
        inputs = _step_inputs(config, max(batches), args.context)
        ops = profile_ops(models[args.profile], inputs)
        result["profile"] = {"format": args.profile, "batch": max(batches), "ops": ops}
        for op in ops:
            print(f"  {op['op']:<40} {op['ms_per_step']:7.3f} ms/step  {op['share']:.0%}")
    result["load_average_after"] = load_average()
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
