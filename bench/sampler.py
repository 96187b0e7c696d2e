"""Time of one sampler pass per step (the worker's `sample`: processors, draw, logprobs and
the transfer of the results to the host) over float32 logits [B, V].

Modes: `greedy` (every row temperature 0, no processors: the bare argmax path), `full`
(everything on: repetition / presence / frequency penalties over 256-token histories, 8
logit-bias entries, active min_tokens, temperature, top-k 50, top-p 0.9, min-p 0.05, half the
rows seeded, logprobs 5) and `temperature` (temperature 1.0 alone: the exponential race over
the whole vocabulary). Runs on CPU, and on CUDA when present. Prints a table (median and
min ms) and writes JSON to bench/results/sampler.json.

    python -m bench.sampler [--batches 1,8,64,256] [--vocabs 4096,32000,128256] [--repeat 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.report import load_average, machine_info
from common.sampling import SamplingParams
from services.worker.sampler import SamplingRow, sample

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("greedy", "full", "temperature")
HISTORY = 256  # tokens per row that the penalties look at (128 prompt + 128 output)


def rows_for(mode: str, batch: int, vocab: int) -> list[SamplingRow]:
    if mode == "greedy":
        return [SamplingRow(SamplingParams())] * batch
    if mode == "temperature":
        return [SamplingRow(SamplingParams(temperature=1.0))] * batch
    generator = torch.Generator().manual_seed(0)
    rows = []
    for i in range(batch):
        history = torch.randint(0, vocab, (HISTORY,), generator=generator).tolist()
        bias = torch.randint(0, vocab, (8,), generator=generator).tolist()
        params = SamplingParams(
            temperature=0.8,
            top_k=50,
            top_p=0.9,
            min_p=0.05,
            repetition_penalty=1.1,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            logit_bias=tuple((t, 1.5) for t in sorted(set(bias))),
            min_tokens=HISTORY,  # 128 outputs so far: the stop tokens are still suppressed
            stop_token_ids=(1, 2),
            seed=i if i % 2 == 0 else None,
            logprobs=5,
        )
        rows.append(SamplingRow(params, history, num_prompt_tokens=HISTORY // 2))
    return rows


def time_pass(logits: torch.Tensor, rows: list[SamplingRow], repeat: int) -> list[float]:
    """Milliseconds per `sample` call: one warm-up, then `repeat` runs (fewer when slow)."""
    generator = torch.Generator(device=logits.device).manual_seed(0)
    sample(logits, rows, generator)
    times: list[float] = []
    budget = time.perf_counter() + 3.0  # keep the slowest points short on a small CPU
    while len(times) < repeat and (len(times) < 2 or time.perf_counter() < budget):
        start = time.perf_counter()
        sample(logits, rows, generator)  # ends with the device-to-host copy: synchronised
        times.append((time.perf_counter() - start) * 1e3)
    return times


def run(devices: list[str], batches: list[int], vocabs: list[int], repeat: int) -> list[dict]:
    results = []
    for device in devices:
        for vocab in vocabs:
            for batch in batches:
                generator = torch.Generator().manual_seed(batch + vocab)
                logits = (torch.randn(batch, vocab, generator=generator) * 3).to(device)
                for mode in MODES:
                    times = time_pass(logits, rows_for(mode, batch, vocab), repeat)
                    results.append(
                        {
                            "device": device,
                            "vocab": vocab,
                            "batch": batch,
                            "mode": mode,
                            "ms_median": round(statistics.median(times), 3),
                            "ms_min": round(min(times), 3),
                            "runs": len(times),
                        }
                    )
                    print(
                        f"{device:5} V={vocab:<7} B={batch:<4} {mode:12} "
                        f"{statistics.median(times):9.2f} ms",
                        flush=True,
                    )
    return results


def format_table(results: list[dict]) -> str:
    """One line per (device, V, B): median (min) ms per mode."""
    cells: dict[tuple, dict[str, str]] = {}
    for r in results:
        text = f"{r['ms_median']:.2f} ({r['ms_min']:.2f})"
        cells.setdefault((r["device"], r["vocab"], r["batch"]), {})[r["mode"]] = text
    header = f"{'device':6} {'vocab':>7} {'batch':>5}" + "".join(f" {m + ' ms':>21}" for m in MODES)
    lines = [header]
    for (device, vocab, batch), by_mode in cells.items():
        values = "".join(f" {by_mode.get(m, '-'):>21}" for m in MODES)
        lines.append(f"{device:6} {vocab:7} {batch:5}" + values)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--vocabs", default="4096,32000,128256")
    parser.add_argument("--repeat", type=int, default=7, help="runs per point (median)")
    parser.add_argument("--device", default="", help="cpu or cuda (default: cpu, and cuda)")
    parser.add_argument("--out", default="", help="JSON path (default bench/results/...)")
    args = parser.parse_args()
    devices = [args.device] if args.device else ["cpu"]
    if not args.device and torch.cuda.is_available():
        devices.append("cuda")
    batches = [int(b) for b in args.batches.split(",")]
    vocabs = [int(v) for v in args.vocabs.split(",")]
    load_before = load_average()
    started = time.perf_counter()
    results = run(devices, batches, vocabs, args.repeat)
    report = {
        "benchmark": "sampler",
        "machine": machine_info(),
        "torch": torch.__version__,
        "cuda_device": torch.cuda.get_device_name() if "cuda" in devices else None,
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "wall_s": round(time.perf_counter() - started, 1),
        "settings": {"modes": list(MODES), "history_tokens": HISTORY, "repeat": args.repeat},
        "results": results,
    }
    print(format_table(results))
    RESULTS.mkdir(exist_ok=True)
    out = Path(args.out) if args.out else RESULTS / "sampler.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
