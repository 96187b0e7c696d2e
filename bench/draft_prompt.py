"""Where a draft model's prompt KV should come from: computed by the decode worker (what
Tandem does) or prefilled on the prefill worker and moved with the target's blocks.

For each prompt length and draft size, on the bench model: the draft's pass over the whole
prompt on the decode side (one `propose_batch` of k = 1 on a fresh request, as a request's
first speculative step does), the target's prefill of the same prompt for scale, and what
moving the draft's KV instead would cost at least: its bytes, and one gather plus one
scatter of its blocks (a same-host transfer runs at about that speed, bench.kv_stream).
JSON goes to bench/results/draft_prompt_cpu.json.

    python -m bench.draft_prompt [--model llama-32m] [--prompt-lens 128 512 2048]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from bench.models import BENCH_MODELS, bench_model
from bench.report import machine_info, write_report
from common.sampling import SamplingParams
from services.worker.batch import WorkerRequest
from services.worker.kv_cache import KvCache
from services.worker.models.attention_metadata import SequenceSlice, build_attention_metadata
from services.worker.models.weight_loader import load_model
from services.worker.spec_decode.draft_model_proposer import DraftModelProposer

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK = 16


def cache_for(config, num_blocks: int) -> KvCache:
    return KvCache(
        num_blocks, BLOCK, config.num_hidden_layers, config.num_key_value_heads,
        config.head_dim, torch.float32,
    )  # fmt: skip


def best_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    return round(min(times), 3)


@torch.inference_mode()
def measure(folder: Path, layers: int | None, prompt_len: int, repeats: int) -> dict:
    model, config = load_model(folder, torch.float32, num_layers=layers)
    num_blocks = -(-(prompt_len + 1) // BLOCK)
    cache = cache_for(config, num_blocks)
    draft = DraftModelProposer(model, cache, torch.device("cpu"))
    tokens = torch.randint(3, config.vocab_size, (prompt_len,)).tolist()
    blocks = list(range(num_blocks))

    def draft_pass() -> None:
        request = WorkerRequest("r", list(tokens), blocks, prompt_len, SamplingParams())
        draft.propose_batch([(request, 1)])

    full = num_blocks - 1 if prompt_len % BLOCK else num_blocks
    staged = cache.gather_blocks(blocks[:full])

    def move() -> None:
        cache.scatter_blocks(blocks[:full], cache.gather_blocks(blocks[:full], out=staged))

    draft_pass()  # warm-up
    return {
        "draft_layers": config.num_hidden_layers,
        "prompt_len": prompt_len,
        "decode_side_pass_ms": best_ms(draft_pass, repeats),
        "draft_kv_bytes": full * cache.block_bytes,
        "gather_scatter_ms": best_ms(move, repeats),
    }


@torch.inference_mode()
def target_prefill_ms(folder: Path, prompt_len: int, repeats: int) -> float:
    model, config = load_model(folder, torch.float32)
    num_blocks = -(-prompt_len // BLOCK)
    cache = cache_for(config, num_blocks)
    ids = torch.randint(3, config.vocab_size, (prompt_len,))
    positions, meta = build_attention_metadata(
        [SequenceSlice(0, prompt_len, range(num_blocks))], BLOCK, torch.device("cpu")
    )

    def prefill() -> None:
        model.compute_logits(model(ids, positions, cache, meta)[-1:])

    prefill()
    return best_ms(prefill, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="llama-32m", choices=list(BENCH_MODELS))
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--draft-layers", type=int, nargs="+", default=[2, 0],
                        help="num_draft_layers to measure (0: the whole model)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS / "draft_prompt_cpu.json"))
    args = parser.parse_args()
    folder = bench_model(args.model)
    rows = []
    for prompt_len in args.prompt_lens:
        target_ms = target_prefill_ms(folder, prompt_len, args.repeats)
        for layers in args.draft_layers:
            row = measure(folder, layers or None, prompt_len, args.repeats)
            row["target_prefill_ms"] = target_ms
            row["pass_over_target_prefill"] = round(row["decode_side_pass_ms"] / target_ms, 3)
            rows.append(row)
            print(row, flush=True)
    report = {
        "benchmark": "draft_prompt",
        "model": args.model,
        "block_size": BLOCK,
        "torch_threads": torch.get_num_threads(),
        "rows": rows,
        "median_pass_over_target_prefill": statistics.median(
            r["pass_over_target_prefill"] for r in rows
        ),
        "machine": machine_info(),
    }
    print(f"wrote {write_report(args.out, report)}")


if __name__ == "__main__":
    main()
