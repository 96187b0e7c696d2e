"""Speculative decoding: time per output token and acceptance with and without
`--speculative-config`, at concurrency 1 and 16, in one run on the same stack shape (1
prefill + 1 decode worker), the same model and the same requests.

Random-weight models never repeat their prompt or themselves, so the workload makes the
output repeat (`--sampling repeat:N`: greedy, with the request's first N prompt tokens pushed
up by logit_bias; logit_bias shifts logits and costs the same with speculation on or off;
N = 1 makes every proposal right, the upper bound; N = 2 gives partial acceptance).
Modes alternate (off, on, off, on, ...; with `--without-switch` a third, the same config
without `disable_by_batch_size`) because the box drifts between runs. Acceptance
comes from the requests' usage (proposed and accepted tokens) and the decode pool's
`GetPoolStats` (mean accepted length = 1 + accepted / verifying steps). JSON goes to
bench/results/spec_decode_cpu.json.

    python -m bench.spec_decode [--model llama-32m] [--speculative-config JSON] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from transformers import AutoTokenizer

from bench.load_runs import bench_stack, pool_stats, run_loads
from bench.models import BENCH_MODELS, bench_model
from bench.report import machine_info, write_report
from bench.workloads import MixedParams, build_workload, usable_token_ids

RESULTS = Path(__file__).resolve().parent / "results"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "disable_by_batch_size": 4}  # fmt: skip
LOADS = ((1, 8), (16, 32))  # (concurrency, requests)


def spec_row(records, summary, before, after) -> dict:
    drafts = sum(r.draft_tokens for r in records)
    accepted = sum(r.accepted_tokens for r in records)
    steps = after.spec_decode_num_steps - before.spec_decode_num_steps
    return {
        "draft_tokens": drafts,
        "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / drafts, 4) if drafts else None,
        "verifying_steps": steps,
        "mean_accepted_length": round(1 + accepted / steps, 3) if steps else None,
        "decode_steps": after.steps - before.steps,
    }


def run_mode(
    model: Path,
    speculative: str,
    requests_by_load,
    sampling: str,
    loads=LOADS,
    extra: dict | None = None,
    label: str = "",
) -> dict:
    """One mode on a fresh stack (`extra`: flags per role; the speculative config, if
    any, joins the decode worker's)."""
    extra = {role: list(flags) for role, flags in (extra or {}).items()}
    if speculative:
        extra["decode"] = [*extra.get("decode", []), "--speculative-config", speculative]
    label = label or ("on" if speculative else "off")
    with bench_stack(model, extra, f"bench-spec-{label}-") as stack:
        spec = stack.spec
        return run_loads(
            spec.gateway_address, model, loads, requests_by_load, f"spec {label}",
            lambda: pool_stats(spec.scheduler_address, role=2),  # WORKER_ROLE_DECODE
            spec_row, sampling,
        )  # fmt: skip


def off_vs_on(runs: dict[str, list[dict]], loads=LOADS) -> dict:
    """Per mode other than "off" and per load, round by round: TPOT p50 off and on, their
    ratio, throughput on / off, acceptance and mean accepted length."""
    out: dict = {}
    for mode in [m for m in runs if m != "off"]:
        for concurrency, _ in loads:
            key = f"c{concurrency}"
            pairs = list(zip([r[key] for r in runs["off"]], [r[key] for r in runs[mode]],
                             strict=True))  # fmt: skip
            out.setdefault(mode, {})[key] = {
                "tpot_p50_ms_off": [a["tpot_ms"]["p50"] for a, _ in pairs],
                "tpot_p50_ms_on": [b["tpot_ms"]["p50"] for _, b in pairs],
                "tpot_p50_off_over_on": [
                    round(a["tpot_ms"]["p50"] / b["tpot_ms"]["p50"], 3) for a, b in pairs
                ],
                "throughput_on_over_off": [
                    round(b["output_tokens_per_s"] / a["output_tokens_per_s"], 3) for a, b in pairs
                ],
                "acceptance_rate": [b["acceptance_rate"] for _, b in pairs],
                "mean_accepted_length": [b["mean_accepted_length"] for _, b in pairs],
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llama-32m", choices=list(BENCH_MODELS))
    parser.add_argument("--speculative-config", default=json.dumps(NGRAM))
    parser.add_argument(
        "--sampling",
        default="repeat:2",
        help="repeat:N (outputs repeat: N prompt tokens pushed up by logit_bias) or greedy",
    )
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1, help="runs per mode, alternating")
    parser.add_argument(
        "--without-switch",
        action="store_true",
        help="also run the config without disable_by_batch_size (speculation at any batch)",
    )
    parser.add_argument("--out", default=str(RESULTS / "spec_decode_cpu.json"))
    args = parser.parse_args()
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
    configs = {"off": ""}
    configs["on"] = args.speculative_config
    if args.without_switch:  # the same config with speculation on at every batch size
        unswitched = {**json.loads(args.speculative_config)}
        unswitched.pop("disable_by_batch_size", None)
        configs["on_no_switch"] = json.dumps(unswitched)
    runs = {mode: [] for mode in configs}
    for _ in range(args.repeats):
        for mode, config in configs.items():
            runs[mode].append(run_mode(model, config, requests_by_load, args.sampling))
    ratios = off_vs_on(runs)
    report = {
        "benchmark": "spec_decode",
        "model": args.model,
        "speculative_config": {m: json.loads(c) if c else None for m, c in configs.items()},
        "sampling": args.sampling,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "loads": [{"concurrency": c, "requests": n} for c, n in LOADS],
        "runs": runs,
        "ratios": ratios,
        "machine": machine_info(),
    }
    print(json.dumps({"ratios": ratios, "runs": runs}, indent=1))
    print(f"wrote {write_report(args.out, report)}")


if __name__ == "__main__":
    main()
