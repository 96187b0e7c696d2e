"""Structured output's cost: TPOT and output tok/s with every request under a JSON schema
against the same requests free, at concurrency 1 and 16, on one stack (1 prefill + 1
decode worker), the two interleaved and repeated; the per-step cost of the mask alone
(16 constrained rows); and compile times of realistic constraints (first compile, cache
off) with the cost of loading xgrammar. JSON goes to bench/results/structured_cpu.json.

    python -m bench.structured [--model llama-32m] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from bench.load_runs import bench_stack, pool_stats, run_loads
from bench.models import BENCH_MODELS, bench_model
from bench.report import machine_info, write_report
from bench.serve_client import run_client
from bench.structured_schemas import COMPILE_CASES, LOAD_SCHEMA
from bench.workloads import MixedParams, build_workload, usable_token_ids
from common.structured_output import Constraint

RESULTS = Path(__file__).resolve().parent / "results"
LOADS = ((1, 8), (16, 48))  # (concurrency, requests)
OUTPUT_LEN = 64


def import_seconds() -> float:
    """`import xgrammar` in a fresh interpreter (it imports torch)."""
    code = "import time; t = time.perf_counter(); import xgrammar; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def compile_times(model: Path) -> dict:
    import xgrammar as xgr

    from common.grammar_cache import GrammarCache

    tokenizer = AutoTokenizer.from_pretrained(model)
    start = time.perf_counter()
    cache = GrammarCache(tokenizer, tokenizer.vocab_size)
    info_s = time.perf_counter() - start
    out = {}
    for label, (kind, value) in COMPILE_CASES.items():
        constraint = Constraint(kind, value)
        times = []
        for _ in range(3):  # a fresh compiler each time: nothing cached
            cache._compiler = xgr.GrammarCompiler(cache.tokenizer_info, cache_enabled=False)
            t = time.perf_counter()
            cache.compile(constraint)
            times.append((time.perf_counter() - t) * 1e3)
        out[label] = round(statistics.median(times), 2)
        print(f"compile {label}: {out[label]} ms", flush=True)
    return {"tokenizer_info_s": round(info_s, 3), "compile_ms": out}


def mask_cost(model: Path, rows: int = 16, steps: int = 50) -> dict:
    """One step's mask for `rows` constrained rows (fill each bitmask row, apply to the
    gathered logits rows, scatter back) and the accepts, on fp32 logits of the vocab."""
    from common.grammar_cache import GrammarCache
    from services.worker.structured.matchers import RequestMatchers

    tokenizer = AutoTokenizer.from_pretrained(model)
    vocab = len(tokenizer)
    cache = GrammarCache(tokenizer, vocab)
    compiled = cache.compile(Constraint("json_schema", json.dumps(LOAD_SCHEMA)))
    prefix = tokenizer.encode('{"title": "a', add_special_tokens=False)
    matchers = RequestMatchers(vocab)
    for r in range(rows):
        matchers.start(f"r{r}", compiled, prefix)
    ids = [(r, f"r{r}") for r in range(rows)]
    letter = tokenizer.encode("a", add_special_tokens=False)[0]
    logits = torch.randn(rows, vocab)
    mask_ms, accept_ms = [], []
    for _ in range(steps):
        t = time.perf_counter()
        matchers.mask(logits, ids)
        mask_ms.append((time.perf_counter() - t) * 1e3)
        t = time.perf_counter()
        for _, rid in ids:
            matchers.accept(rid, letter)  # stays inside the title string
        accept_ms.append((time.perf_counter() - t) * 1e3)
    return {"rows": rows, "vocab": vocab, "mask_ms_p50": round(statistics.median(mask_ms), 3),
            "accept_ms_p50": round(statistics.median(accept_ms), 3)}  # fmt: skip


def no_row(records, summary, before, after) -> dict:
    return {"decode_steps": after.steps - before.steps}


def serving(model: Path, rounds: int, num_requests: int) -> dict:
    vocab = usable_token_ids(AutoTokenizer.from_pretrained(model))
    params = MixedParams(num_requests=num_requests, prompt_len_median=128.0,
                         prompt_len_range=(64, 256),
                         output_len_range=(OUTPUT_LEN, OUTPUT_LEN))  # fmt: skip
    requests = build_workload("mixed", vocab, params, seed=0)
    by_load = [requests[:n] for _, n in LOADS]
    runs: dict[str, list[dict]] = {"free": [], "json": []}
    with bench_stack(model, {}, "bench-structured-") as stack:
        spec = stack.spec
        run_client(
            spec.gateway_address,
            requests[:2],
            None,
            2,
            "warm",
            show_progress=False,
            sampling="json",
        )  # fmt: skip  (compiles the schema, loads xgrammar)
        for r in range(rounds):
            for mode in ("free", "json"):
                result = run_loads(
                    spec.gateway_address, model, LOADS, by_load, f"{mode} r{r}",
                    lambda: pool_stats(spec.scheduler_address, role=2), no_row, sampling=mode,
                )  # fmt: skip
                runs[mode].append(result)
                for load, row in result.items():
                    print(mode, load, row["output_tokens_per_s"], "tok/s, TPOT p50",
                          row["tpot_ms"]["p50"], flush=True)  # fmt: skip
    summary = {}
    for concurrency, _ in LOADS:
        key = f"c{concurrency}"
        tpot = {m: statistics.median(r[key]["tpot_ms"]["p50"] for r in runs[m]) for m in runs}
        tps = {m: statistics.median(r[key]["output_tokens_per_s"] for r in runs[m]) for m in runs}
        summary[key] = {
            "tpot_p50_ms": tpot,
            "output_tokens_per_s": tps,
            "tpot_ratio_json_to_free": round(tpot["json"] / tpot["free"], 3),
        }
        print(key, summary[key], flush=True)
    return {"runs": runs, "summary": summary}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llama-32m", choices=list(BENCH_MODELS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS / "structured_cpu.json"))
    args = parser.parse_args()
    model = bench_model(args.model)
    report = {
        "model": args.model,
        "loads": [{"concurrency": c, "requests": n, "output_len": OUTPUT_LEN} for c, n in LOADS],
        "schema": LOAD_SCHEMA,
        "import_xgrammar_s": round(import_seconds(), 3),
    }
    report |= compile_times(model)
    report["mask_step"] = mask_cost(model)
    print("mask", report["mask_step"], flush=True)
    report["serving"] = serving(model, args.rounds, max(n for _, n in LOADS))
    report["machine"] = machine_info()
    write_report(args.out, report)


if __name__ == "__main__":
    main()
