"""Beam search speed: Tandem's beam search through the services (1 prefill + 1 decode
worker) against HF `generate(num_beams=k, do_sample=False)` on the same prompts, model and
k, in one run. Tandem: the prompts one at a time (concurrency 1) and 8 at once; HF: one
prompt at a time (its beams batched) and 8 prompts per call (left-padded). Reported: best-
hypothesis tokens per second (what a client gets) and beam tokens per second (k per step,
what the model computes), and the first prompt's hypothesis compared with HF's.
JSON goes to bench/results/beam_cpu.json.

    python -m bench.beam [--model llama-32m] [--num-prompts 16] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.load_runs import bench_stack
from bench.models import BENCH_MODELS, bench_model
from bench.report import machine_info, write_report
from bench.workloads import MixedParams, build_workload, usable_token_ids
from common.pb.tandem.v1 import generate_pb2, generate_pb2_grpc

RESULTS = Path(__file__).resolve().parent / "results"
WIDTHS = (2, 4, 8)
BATCH = 8


def tandem_beam(address: str, prompt: list[int], k: int, max_tokens: int) -> list[int]:
    request = generate_pb2.GenerateRequest(max_tokens=max_tokens)
    request.token_ids.ids.extend(prompt)
    request.beam_search.beam_width = k
    tokens: list[int] = []
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        for message in stub.Generate(request, timeout=600):
            if message.index == 0:
                tokens.extend(message.token_ids)
    return tokens


def run_tandem(address: str, prompts, k: int, max_tokens: int, concurrency: int) -> dict:
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outs = list(pool.map(lambda p: tandem_beam(address, p, k, max_tokens), prompts))
    wall = time.perf_counter() - start
    tokens = sum(len(o) for o in outs)
    return {"wall_s": round(wall, 3), "output_tokens_per_s": round(tokens / wall, 2),
            "beam_tokens_per_s": round(tokens * k / wall, 2), "first": outs[0]}  # fmt: skip


@torch.inference_mode()
def run_hf(model, eos: int, prompts, k: int, max_tokens: int, batch: int) -> dict:
    outs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        width = max(len(p) for p in group)
        ids = torch.tensor([[eos] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        seqs = model.generate(
            ids, attention_mask=mask, num_beams=k, do_sample=False, max_new_tokens=max_tokens,
            pad_token_id=eos,
        )  # fmt: skip
        outs.extend(s[width:].tolist() for s in seqs)
    wall = time.perf_counter() - start
    tokens = sum(len(o) for o in outs)
    return {"wall_s": round(wall, 3), "output_tokens_per_s": round(tokens / wall, 2),
            "beam_tokens_per_s": round(tokens * k / wall, 2), "first": outs[0]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llama-32m", choices=list(BENCH_MODELS))
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", default=str(RESULTS / "beam_cpu.json"))
    args = parser.parse_args()
    folder = bench_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    params = MixedParams(num_requests=args.num_prompts, prompt_len_median=96.0,
                         prompt_len_range=(64, 128),
                         output_len_range=(args.max_tokens, args.max_tokens))  # fmt: skip
    workload = build_workload("mixed", usable_token_ids(tokenizer), params, 0)
    prompts = [list(r.prompt_ids) for r in workload]
    results: dict[str, dict] = {}
    with bench_stack(folder, {}, "bench-beam-") as stack:
        address = stack.spec.gateway_address
        tandem_beam(address, prompts[0], 2, 4)  # warm up
        for k in WIDTHS:
            for c in (1, BATCH):
                row = run_tandem(address, prompts, k, args.max_tokens, c)
                results[f"tandem k{k} c{c}"] = row
                print(f"tandem k{k} c{c}", row["output_tokens_per_s"], "tok/s", flush=True)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    for k in WIDTHS:
        for b in (1, BATCH):
            row = run_hf(model, eos, prompts, k, args.max_tokens, b)
            results[f"hf k{k} bs{b}"] = row
            print(f"hf k{k} bs{b}", row["output_tokens_per_s"], "tok/s", flush=True)
    ratios = {
        f"k{k}": {
            "c1_vs_hf_bs1": round(results[f"tandem k{k} c1"]["output_tokens_per_s"]
                                  / results[f"hf k{k} bs1"]["output_tokens_per_s"], 3),
            f"c{BATCH}_vs_hf_bs{BATCH}": round(
                results[f"tandem k{k} c{BATCH}"]["output_tokens_per_s"]
                / results[f"hf k{k} bs{BATCH}"]["output_tokens_per_s"], 3),
            "first_prompt_equal_to_hf_bs1": results[f"tandem k{k} c1"]["first"]
            == results[f"hf k{k} bs1"]["first"],
        }
        for k in WIDTHS
    }  # fmt: skip
    print(ratios)
    write_report(args.out, {"model": args.model, "num_prompts": args.num_prompts,
                            "max_tokens": args.max_tokens, "results": results,
                            "ratios": ratios, "machine": machine_info()})  # fmt: skip


if __name__ == "__main__":
    main()
