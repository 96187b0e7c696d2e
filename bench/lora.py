"""Multi-LoRA throughput: output tok/s and TPOT at concurrency 16 with the requests spread
over 1, 4 and 16 distinct LoRA adapters, against the base model alone, in one run on the
same stack shape (1 prefill + 1 decode worker), model and requests. The adapters are
PEFT-made (rank 16 on q/k/v/o, random weights); the LoRA stack loads all 16 with
`--max-loras 16`, so every mix runs in one batch. "base (LoRA on)" sends the same requests
without an adapter to the LoRA stack; "base (LoRA off)" to a stack started without LoRA.
JSON goes to bench/results/lora_cpu.json.

    python -m bench.lora [--model llama-32m] [--num-requests 48]
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.load_runs import bench_stack, pool_stats, run_loads
from bench.models import BENCH_MODELS, bench_model
from bench.report import machine_info, write_report
from bench.workloads import MixedParams, build_workload, usable_token_ids

RESULTS = Path(__file__).resolve().parent / "results"
NUM_ADAPTERS = 16
CONCURRENCY = 16
MIXES = (0, 1, 4, 16)  # distinct adapters over the requests (0: the base model)


def make_adapters(model: Path, out: Path) -> dict[str, Path]:
    from peft import LoraConfig, get_peft_model

    adapters = {}
    for i in range(NUM_ADAPTERS):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        config = LoraConfig(r=16, lora_alpha=32, init_lora_weights=False,
                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])  # fmt: skip
        get_peft_model(base, config).save_pretrained(out / f"a{i}")
        adapters[f"a{i}"] = out / f"a{i}"
    return adapters


def no_row(records, summary, before, after) -> dict:
    return {"decode_steps": after.steps - before.steps}


def run_stack(model: Path, extra: dict, loads: dict[str, list]) -> dict:
    with bench_stack(model, extra, "bench-lora-") as stack:
        spec, out = stack.spec, {}
        for label, requests in loads.items():
            result = run_loads(
                spec.gateway_address, model, [(CONCURRENCY, len(requests))], [requests], label,
                lambda: pool_stats(spec.scheduler_address, role=2), no_row,
            )  # fmt: skip
            out[label] = result[f"c{CONCURRENCY}"]
            print(label, out[label]["output_tokens_per_s"], "tok/s", flush=True)
        return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llama-32m", choices=list(BENCH_MODELS))
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--out", default=str(RESULTS / "lora_cpu.json"))
    args = parser.parse_args()
    model = bench_model(args.model)
    adapters = make_adapters(model, Path(tempfile.mkdtemp(prefix="bench-adapters-")))
    vocab = usable_token_ids(AutoTokenizer.from_pretrained(model))
    params = MixedParams(num_requests=args.num_requests, prompt_len_median=128.0,
                         prompt_len_range=(64, 256), output_len_range=(64, 64))  # fmt: skip
    requests = build_workload("mixed", vocab, params, seed=0)
    names = list(adapters)

    def mix(k: int) -> list:
        return [dataclasses.replace(r, lora_name=names[r.index % k] if k else "")
                for r in requests]  # fmt: skip

    modules = ",".join(f"{n}={p}" for n, p in adapters.items())
    lora = ["--enable-lora", "--lora-modules", modules, "--max-loras", str(NUM_ADAPTERS),
            "--max-lora-rank", "16"]  # fmt: skip
    results = {"base (LoRA off)": run_stack(model, {}, {"base (LoRA off)": mix(0)})[
        "base (LoRA off)"]}  # fmt: skip
    results |= run_stack(
        model, {"prefill": lora, "decode": lora},
        {"base (LoRA on)": mix(0), **{f"{k} adapters": mix(k) for k in MIXES if k}},
    )  # fmt: skip
    base = results["base (LoRA off)"]["output_tokens_per_s"]
    ratios = {label: round(r["output_tokens_per_s"] / base, 3) for label, r in results.items()}
    print("vs base (LoRA off):", ratios)
    write_report(
        args.out,
        {
            "model": args.model,
            "concurrency": CONCURRENCY,
            "num_requests": args.num_requests,
            "adapters": "rank 16 on q/k/v/o, random",
            "results": results,
            "ratio_to_base": ratios,
            "machine": machine_info(),
        },
    )


if __name__ == "__main__":
    main()
