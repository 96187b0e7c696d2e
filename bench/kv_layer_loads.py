"""Does a CPU worker gain by loading its offload-tier hits layer by layer, beside the
forward pass, instead of whole blocks before it? In process, no services: the worker's own
model, pool and host tier (`startup.load_worker`), one prefill step of one request whose
first N blocks are tier hits and whose last M tokens are computed, timed three ways,
alternated round by round so that a slow spell of the shared box lands on each alike:

    whole   the connector's CPU path: `KvCache.copy_blocks` from the tier, then the
            forward pass (up to 471833f a gather into a temporary, then one copy per run
            of consecutive blocks; after it, one copy per run straight from the tier)
    runs    whole-block loads as one copy per run, straight from tier to pool, written
            out here: the control for `whole`
    layers  a loader thread copies layer slot by layer slot (one copy per run per slot,
            numpy, which drops the GIL and starts no OpenMP team) while the forward pass
            runs; each layer waits for its slot (`KvCache.on_layer_needed`) before attention

The step's logits must be bit-equal across the three. Each cell is the median (and min) of
`--rounds` steps, with the ms the step spent loading (`whole`, `runs`: the copies; `layers`:
the pass waiting for a slot); tier and pool blocks rotate over a region 4x the loads.
JSON goes to bench/results/kv_layer_loads_cpu.json (`--out`).

    python -m bench.kv_layer_loads [--models llama-32m,SmolLM2-135M-Instruct]
        [--loads 8,32,64] [--new 16,64] [--rounds 12]
"""

from __future__ import annotations

import argparse
import queue
import statistics
import threading
import time
from pathlib import Path

import numpy as np
import torch

from bench.report import load_average, machine_info, write_report
from services.worker.config import WorkerConfig
from services.worker.kv_cache import KvCache, block_runs
from services.worker.models.attention_metadata import SequenceSlice, build_attention_metadata
from services.worker.startup import load_worker

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = Path(__file__).resolve().parents[1] / ".tandem" / "models"
BLOCK = 16
ROTATE = 4  # tier and pool regions the loads cycle over
WAYS = ("whole", "runs", "layers")


class LayerLoader:
    """A thread that copies tier blocks into the pool one layer slot at a time; a forward
    pass waits for slot i's event before layer i reads the cache."""

    def __init__(self, pool: KvCache, tier: KvCache) -> None:
        self.pool, self.tier = pool.bytes.numpy(), tier.bytes.numpy()
        self.slots = [slot for _, slot in pool.layer_slots]
        self.done = [threading.Event() for _ in range(pool.num_layers)]
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.waited = 0.0  # seconds the pass waited for its slots, this step
        threading.Thread(target=self._run, daemon=True, name="layer-loads").start()

    def start(self, pairs: list[tuple[int, int]]) -> None:
        for event in self.done:
            event.clear()
        self.waited = 0.0
        self._jobs.put(block_runs([p[0] for p in pairs], [p[1] for p in pairs]))

    def wait(self, layer: int) -> None:
        event = self.done[self.slots[layer]]
        if not event.is_set():
            started = time.perf_counter()
            event.wait()
            self.waited += time.perf_counter() - started

    def _run(self) -> None:
        while True:
            runs = self._jobs.get()
            for slot in range(len(self.done)):
                for s, d, n in runs:
                    np.copyto(self.pool[d : d + n, slot], self.tier[s : s + n, slot])
                self.done[slot].set()


def copy_runs(pool: KvCache, tier: KvCache, pairs: list[tuple[int, int]]) -> None:
    for s, d, n in block_runs([p[0] for p in pairs], [p[1] for p in pairs]):
        pool.bytes[d : d + n].copy_(tier.bytes[s : s + n])


@torch.inference_mode()
def step(way: str, loaded, loader: LayerLoader, pairs, ids, positions, meta):
    """One prefill step's loads and forward pass: its last token's logits, and the ms it
    spent loading (`layers`: waiting for a slot)."""
    model, pool, tier = loaded.model, loaded.kv_cache, loaded.offload_cache
    started = time.perf_counter()
    if way == "whole":
        pool.copy_blocks(pairs, source=tier)
    elif way == "runs":
        copy_runs(pool, tier, pairs)
    else:
        loader.start(pairs)
        pool.on_layer_needed = loader.wait
    loading = time.perf_counter() - started
    try:
        hidden = model(ids, positions, pool, meta)
    finally:
        pool.on_layer_needed = None
    if way == "layers":
        loading = loader.waited
    return model.compute_logits(hidden[-1:]), loading * 1e3


def bench_model(folder: Path, loads: list[int], news: list[int], rounds: int) -> dict:
    most = max(loads) + -(-max(news) // BLOCK)
    config = WorkerConfig(
        model=str(folder), num_blocks=ROTATE * most + 1, max_model_len=BLOCK * most,
        kv_offload_cpu_bytes="256MiB", kv_transfer_shared_memory=False, cpu_compute_lock="off",
    )  # fmt: skip
    loaded = load_worker(config, "bench")
    pool, tier = loaded.kv_cache, loaded.offload_cache
    if tier.num_blocks < ROTATE * max(loads):
        raise SystemExit(f"the tier holds {tier.num_blocks} blocks, fewer than the bench needs")
    generator = torch.Generator().manual_seed(0)
    used = tier.data[: ROTATE * max(loads)]
    used.copy_(torch.randn(used.shape, generator=generator) * 0.5)
    loader = LayerLoader(pool, tier)
    vocab = loaded.model_config.vocab_size
    cells: dict = {}
    for n_loads in loads:
        for n_new in news:
            per_seq = n_loads + -(-n_new // BLOCK)
            times: dict[str, list[float]] = {way: [] for way in WAYS}
            loading: dict[str, list[float]] = {way: [] for way in WAYS}
            logits: dict[str, torch.Tensor] = {}
            for round_ in range(rounds + 1):  # round 0 warms up, untimed
                region = round_ % ROTATE
                src = [region * max(loads) + i for i in range(n_loads)]
                table = [1 + region * most + i for i in range(per_seq)]
                pairs = list(zip(src, table[:n_loads], strict=True))
                ids = torch.randint(0, vocab, (n_new,), generator=generator)
                slices = [SequenceSlice(n_loads * BLOCK, n_new, table, n_loads * BLOCK + n_new)]
                positions, meta = build_attention_metadata(slices, BLOCK, pool.device)
                order = WAYS if round_ % 2 == 0 else WAYS[::-1]
                for way in order:
                    pool.data[table].zero_()
                    started = time.perf_counter()
                    logits[way], load_ms = step(way, loaded, loader, pairs, ids, positions, meta)
                    if round_:
                        times[way].append((time.perf_counter() - started) * 1e3)
                        loading[way].append(load_ms)
                if not all(torch.equal(logits[w], logits["whole"]) for w in WAYS):
                    raise AssertionError("the three ways computed different logits")
            cell = {
                way: {
                    "median_ms": round(statistics.median(t), 2),
                    "min_ms": round(min(t), 2),
                    "load_median_ms": round(statistics.median(loading[way]), 2),
                }
                for way, t in times.items()
            }
            cell["load_MB"] = round(n_loads * pool.block_bytes / 1e6, 2)
            cells[f"{n_loads}x{n_new}"] = cell
            steps = "  ".join(
                f"{w} {cell[w]['median_ms']:8.2f} ({cell[w]['min_ms']:.2f})" for w in WAYS
            )
            loads_ms = "/".join(str(cell[w]["load_median_ms"]) for w in WAYS)
            print(
                f"{folder.name} loads={n_loads:<3} new={n_new:<3} {steps} ms median (min);"
                f" loading {loads_ms} ms; {cell['load_MB']} MB",
                flush=True,
            )
    return {"block_bytes": pool.block_bytes, "layers": pool.num_layers, "cells": cells}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama-32m,SmolLM2-135M-Instruct")
    parser.add_argument("--loads", default="8,32,64", help="tier blocks the step loads")
    parser.add_argument("--new", default="16,64", help="tokens the step computes")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--out", default=str(RESULTS / "kv_layer_loads_cpu.json"))
    args = parser.parse_args()
    loads = [int(n) for n in args.loads.split(",")]
    news = [int(n) for n in args.new.split(",")]
    report = {
        "machine": machine_info(),
        "load_average_before": load_average(),
        "block_size": BLOCK,
        "rounds": args.rounds,
        "note": "ms per step (loads + forward + last logits), median and min of the rounds; "
        "load_median_ms: the copies (whole, runs) or the pass's waits for a slot (layers); "
        "keys are <tier blocks loaded>x<tokens computed>",
        "models": {},
    }
    for name in args.models.split(","):
        report["models"][name] = bench_model(MODELS / name, loads, news, args.rounds)
    report["load_average_after"] = load_average()
    print("wrote", write_report(args.out, report))


if __name__ == "__main__":
    main()
