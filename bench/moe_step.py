"""One forward step of a mixture-of-experts model on its own (no services, no sampler), and
the share of it spent in the experts: a decode step of B sequences of L cached tokens each,
and a prefill step of P prompts of N tokens, each timed whole and with the time inside every
layer's experts (`moe.Experts.forward`: grouping, the per-expert products, the weighted sum)
and inside the whole sparse block (router too) added up around them. torch runs CPU ops
synchronously, so a wall-clock timer around a module is the module's time.

Variants, loaded side by side and interleaved so that a slow spell of the shared box lands
on each alike: `packed` (the experts' products through the model's packed GEMM plan, as the
worker runs them) and `plain` (the same model with the per-expert products on the stacked
transposed weights, `torch.mm`: the path before issue 43's change).

    python -m bench.moe_step [--model .tandem/models/qwen3-moe-tiny] [--variants packed,plain]
        [--batches 1,16] [--context 192] [--prefill 1x128,4x128] [--out ...]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.models import bench_model
from bench.report import load_average, machine_info
from services.worker.kv_cache import KvCache
from services.worker.models.attention_metadata import SequenceSlice, build_attention_metadata
from services.worker.models.moe import Experts, SparseMoeBlock
from services.worker.models.weight_loader import load_model

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK = 16


class Timers:
    """Seconds spent inside `Experts.forward` and `SparseMoeBlock.forward`, while on."""

    def __init__(self) -> None:
        self.on = False
        self.seconds = {"experts": 0.0, "moe_block": 0.0}

    def wrap(self, key: str, forward: Callable) -> Callable:
        def timed(module, *args, **kwargs):
            if not self.on:
                return forward(module, *args, **kwargs)
            start = time.perf_counter()
            try:
                return forward(module, *args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - start

        return timed


TIMERS = Timers()
Experts.forward = TIMERS.wrap("experts", Experts.forward)
SparseMoeBlock.forward = TIMERS.wrap("moe_block", SparseMoeBlock.forward)


def _inputs(config, slices_spec: list[tuple[int, int]]):
    """(ids, positions, cache, metadata) for sequences of (cached, new) tokens."""
    per_seq = [-(-(cached + new) // BLOCK) for cached, new in slices_spec]
    cache = KvCache(
        sum(per_seq) + 1,
        BLOCK,
        config.num_hidden_layers,
        config.num_key_value_heads,
        config.head_dim,
        torch.float32,
    )
    blocks = list(range(sum(per_seq)))
    random.Random(0).shuffle(blocks)
    slices, at = [], 0
    for (cached, new), count in zip(slices_spec, per_seq, strict=True):
        slices.append(SequenceSlice(cached, new, blocks[at : at + count]))
        at += count
    positions, meta = build_attention_metadata(slices, BLOCK, torch.device("cpu"))
    total = sum(new for _, new in slices_spec)
    ids = torch.randint(0, config.vocab_size, (total,), generator=torch.Generator().manual_seed(0))
    return ids, positions, cache, meta


def _step(model, inputs) -> None:
    ids, positions, cache, meta = inputs
    hidden = model(ids, positions, cache, meta)
    model.compute_logits(hidden[meta.last_token_indices])  # as the worker: last tokens


def _plain(model) -> None:
    """Drop the per-expert layers (and their packed copies): `torch.mm` on the stacked."""
    for module in model.modules():
        if isinstance(module, Experts):
            module.projections = None


@torch.inference_mode()
def time_cell(models: dict, inputs, rounds: int, steps: int) -> dict[str, dict[str, float]]:
    """Per variant: median step ms (median over rounds of each round's median) and the
    share of the step inside the experts and inside the whole sparse block."""
    for model in models.values():
        _step(model, inputs)
    step_ms: dict[str, list[float]] = {name: [] for name in models}
    share: dict[str, dict[str, list[float]]] = {
        name: {"experts": [], "moe_block": []} for name in models
    }
    for _ in range(rounds):
        for name, model in models.items():
            times = []
            TIMERS.seconds = dict.fromkeys(TIMERS.seconds, 0.0)
            TIMERS.on = True
            for _ in range(steps):
                start = time.perf_counter()
                _step(model, inputs)
                times.append(time.perf_counter() - start)
            TIMERS.on = False
            step_ms[name].append(statistics.median(times) * 1e3)
            for key, seconds in TIMERS.seconds.items():
                share[name][key].append(seconds / sum(times))
    return {
        name: {
            "median_ms": round(statistics.median(step_ms[name]), 2),
            "min_ms": round(min(step_ms[name]), 2),
            "experts_share": round(statistics.median(share[name]["experts"]), 3),
            "moe_block_share": round(statistics.median(share[name]["moe_block"]), 3),
        }
        for name in models
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-moe-tiny", help="bench model name or path")
    parser.add_argument("--variants", default="packed,plain")
    parser.add_argument("--cpu-gemm", default="auto")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--prefill", default="1x128,4x128", help="PROMPTSxTOKENS,...")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS / "moe_step.json"))
    args = parser.parse_args()
    path = args.model if Path(args.model).is_dir() else str(bench_model(args.model))
    models, plans = {}, {}
    for variant in [v for v in args.variants.split(",") if v]:
        model, config = load_model(path, dtype=torch.float32)
        _, plan = model.pack_weights(args.cpu_gemm)
        if variant == "plain":
            _plain(model)
        elif variant != "packed":
            raise SystemExit(f"unknown variant {variant!r}")
        models[variant], plans[variant] = model, plan.summary()
    cells: dict[str, list[tuple[int, int]]] = {}
    for batch in (int(b) for b in args.batches.split(",") if b):
        cells[f"decode B={batch} L={args.context}"] = [(args.context, 1)] * batch
    for spec in (s for s in args.prefill.split(",") if s):
        prompts, tokens = (int(v) for v in spec.split("x"))
        cells[f"prefill {prompts}x{tokens}"] = [(0, tokens)] * prompts
    result = {
        "machine": machine_info(),
        "load_average_before": load_average(),
        "model": path,
        "torch_threads": torch.get_num_threads(),
        "plans": plans,
        "cells": {},
    }
    for label, spec in cells.items():
        cell = time_cell(models, _inputs(config, spec), args.rounds, args.steps)
        result["cells"][label] = cell
        line = "  ".join(
            f"{n} {c['median_ms']:7.2f} ms (experts {c['experts_share']:.0%}, "
            f"block {c['moe_block_share']:.0%})"
            for n, c in cell.items()
        )
        print(f"{label:<22} {line}", flush=True)
    result["load_average_after"] = load_average()
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
