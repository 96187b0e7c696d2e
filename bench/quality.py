"""Quality on a real model (issue 41): SmolLM2-135M-Instruct, the default model, judged on
the held-out text the project ships (`bench/quality_heldout.txt`), every number through the
real services and, where one exists, against a reference run beside it:

- perplexity (`bench.quality_ppl`) of the float model with the float KV cache and with
  `--kv-cache-dtype fp8`, and of the quantized-weight checkpoints (`bench.quality_weights`:
  FP8 compressed-tensors, GPTQ 4 and 8 bits), each against HF transformers fp32 (the float
  and FP8 checkpoints) or gptqmodel (GPTQ). A step budget of 64 tokens chunks every
  window, so all but a window's first 64 tokens attend to keys and values read back from
  the cache (with a whole window in one step, attention reads the fresh float keys and an
  fp8 cache changes nothing);
- speculative decoding on prompts whose answers copy from the prompt
  (`bench.quality_spec`): acceptance and c1 / c16 TPOT and throughput, off vs n-gram vs
  the target's own first layers as the draft;
- structured output (`bench.quality_tasks`): JSON-schema requests of realistic shapes,
  validated, values typed and non-empty;
- beam search k=4 on chat prompts against HF's beam search.

    python -m bench.quality [--sections ppl,spec,tasks] [--rounds 2]

Writes bench/results/quality_smollm2.json (section by section, as each ends) and prints the
table docs/performance.md carries.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from bench.load_runs import bench_stack
from bench.quality_ppl import (
    STRIDE,
    WINDOW,
    compare,
    heldout_text,
    hf_logprobs,
    perplexity,
    scored,
    tandem_logprobs,
    windows,
)

RESULTS = Path(__file__).resolve().parent / "results"
CHUNK = 64  # the step budget while scoring: the cache is read for all but 64 tokens


def _stack_ppl(folder: Path, wins, kv_dtype: str = "auto") -> tuple[list[float], float]:
    extra = {"scheduler": ["--max-num-batched-tokens", str(CHUNK)],
             "both": ["--kv-cache-dtype", kv_dtype]}  # fmt: skip
    with bench_stack(folder, extra, "bench-quality-ppl-", prefill=0, decode=0, both=1) as stack:
        start = time.perf_counter()
        ours = scored(tandem_logprobs(stack.spec.gateway_address, wins), wins)
        return ours, time.perf_counter() - start


def ppl_section(source: Path, tokenizer, gptq: bool) -> dict:
    from bench import quality_weights as qw

    ids = tokenizer(heldout_text())["input_ids"]
    wins = windows(ids)
    rows: list[dict] = []
    hf_float = scored(hf_logprobs(source, wins), wins)
    base = perplexity(hf_float)

    def row(name: str, ours: list[float], secs: float, reference: list[float] | None,
            reference_name: str | None, **extra) -> None:  # fmt: skip
        entry = {"config": name, "perplexity": round(perplexity(ours), 4),
                 "vs_float_model": round(perplexity(ours) / base - 1, 5),
                 "scoring_s": round(secs, 1), **extra}  # fmt: skip
        if reference is not None:
            entry |= {"reference": reference_name, "reference_perplexity":
                      round(perplexity(reference), 4), **compare(ours, reference)}  # fmt: skip
        rows.append(entry)
        print("ppl:", json.dumps(entry), flush=True)

    for kv in ("auto", "fp8"):
        ours, secs = _stack_ppl(source, wins, kv)
        name = "float weights, float KV" if kv == "auto" else "float weights, fp8 KV (e4m3)"
        row(name, ours, secs, hf_float, "HF transformers fp32 (float KV)", kv_cache_dtype=kv)
    fp8 = qw.build_fp8(source)
    ours, secs = _stack_ppl(fp8, wins)
    reference = scored(hf_logprobs(fp8, wins), wins)
    row("FP8 weights (compressed-tensors, per channel)", ours, secs, reference,
        "HF transformers (compressed-tensors)", folder=fp8.name)  # fmt: skip
    for variant in qw.GPTQ_VARIANTS if gptq else ():
        built = qw.build_gptq(source, variant)
        if "error" in built:
            rows.append({"config": variant, "error": built["error"]})
            print("ppl:", variant, built["error"], flush=True)
            continue
        folder = Path(built["folder"])
        ours, secs = _stack_ppl(folder, wins)
        ref = qw.gptq_reference_logprobs(folder, [list(w.tokens) for w in wins])
        reference = scored(ref["logprobs"], wins) if "logprobs" in ref else None
        failed = {"reference_error": ref["error"][-300:]} if "error" in ref else {}
        bits, group, sym = qw.GPTQ_VARIANTS[variant]
        row(f"GPTQ {bits}-bit, groups of {group}, {'sym' if sym else 'asym'} (gptqmodel)",
            ours, secs, reference, "gptqmodel (its CPU kernels)", folder=folder.name,
            quantize=built.get("quantize_s"), library=built.get("library"), **failed)  # fmt: skip
    return {
        "text_tokens": len(ids),
        "scored_tokens": len(hf_float),
        "window": WINDOW,
        "stride": STRIDE,
        "step_budget_tokens": CHUNK,
        "hf_fp32_perplexity": round(base, 4),
        "rows": rows,
    }


def tasks_section(source: Path, tokenizer) -> dict:
    from bench.quality_tasks import beam, structured

    with bench_stack(source, {}, "bench-quality-tasks-") as stack:
        address = stack.spec.gateway_address
        out = {"structured": structured(address, tokenizer)}
        print("structured:", out["structured"]["valid"], "valid,",
              out["structured"]["typed_and_non_empty"], "typed and non-empty of",
              out["structured"]["count"], flush=True)  # fmt: skip
        out["beam"] = beam(address, source, tokenizer)
        print("beam:", out["beam"]["exact"], "of", out["beam"]["count"], "HF-exact", flush=True)
    return out


def table(result: dict) -> str:
    lines = []
    ppl = result.get("ppl")
    if ppl:
        lines += ["| weights / KV | perplexity | vs float model | reference | ref. ppl | "
                  "max abs log-prob diff |", "|---|---|---|---|---|---|"]  # fmt: skip
        for r in ppl["rows"]:
            if "error" in r:
                lines.append(f"| {r['config']} | failed: {r['error'][:60]} | | | | |")
                continue
            lines.append(
                f"| {r['config']} | {r['perplexity']:.3f} | {100 * r['vs_float_model']:+.2f}% "
                f"| {r.get('reference', '-')} | {r.get('reference_perplexity', '-')} | "
                f"{r.get('max_abs_logprob_diff', '-')} |"
            )
    spec = result.get("spec")
    if spec:
        lines += ["", "| speculation | load | acceptance | TPOT p50 off -> on (ms) | "
                  "TPOT speed-up | throughput on/off |", "|---|---|---|---|---|---|"]  # fmt: skip
        for mode, loads in spec["summary"].items():
            for load, s in loads.items():
                lines.append(
                    f"| {mode} | {load} | {s['acceptance_rate']} | {s['tpot_p50_ms_off']} -> "
                    f"{s['tpot_p50_ms_on']} | {s['tpot_p50_off_over_on']} | "
                    f"{s['throughput_on_over_off']} |"
                )
    tasks = result.get("tasks")
    if tasks:
        st, bm = tasks["structured"], tasks["beam"]
        lines += [
            "",
            f"structured output: {st['valid']}/{st['count']} schema-valid, "
            f"{st['typed_and_non_empty']}/{st['count']} typed and non-empty; beam search "
            f"k={bm['beam_width']}: {bm['exact']}/{bm['count']} prompts HF-exact",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sections", default="ppl,spec,tasks")
    parser.add_argument("--rounds", type=int, default=2, help="speculation rounds, alternated")
    parser.add_argument("--no-gptq", action="store_true", help="skip the GPTQ checkpoints")
    parser.add_argument("--out", type=Path, default=RESULTS / "quality_smollm2.json")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from devtools.default_model import build

    source = build()
    tokenizer = AutoTokenizer.from_pretrained(source)
    # Sections not rerun keep their last results.
    result: dict = json.loads(args.out.read_text()) if args.out.exists() else {}
    result |= {"benchmark": "quality", "model": source.name, "date": time.strftime("%F"),
                    "machine": {"cpus": os.cpu_count(),
                                "processor": platform.processor()}}  # fmt: skip
    sections = args.sections.split(",")

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")

    if "ppl" in sections:
        result["ppl"] = ppl_section(source, tokenizer, gptq=not args.no_gptq)
        save()
    if "spec" in sections:
        from bench.quality_spec import speculation

        result["spec"] = speculation(source, tokenizer, rounds=args.rounds)
        save()
    if "tasks" in sections:
        result["tasks"] = tasks_section(source, tokenizer)
        save()
    print(table(result))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
