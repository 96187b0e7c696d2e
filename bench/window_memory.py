"""KV blocks a request holds on a sliding-window model against full attention, through the
real services (issue 43's memory target).

Two tiny Mistral checkpoints alike but for the window: every layer windowed (`--window`
tokens) and full attention. Then a tiny Gemma 2 (sliding / full layers alternating: two KV
groups) served with a table per KV group (`common.kv_groups`) and with
`--disable-hybrid-kv-cache-manager` (one table: every layer keeps every block). Each is
served by a stack with one worker that prefills and decodes. For each context of m x the
window (m in `--multiples`), one greedy request with a prompt of that length runs; once it
has streamed a few tokens the worker is frozen (so the request surely holds its blocks) and
the scheduler's pool stats give the blocks it holds.
The ratio windowed / full is set beside the ideal, (window + one block) / context: a query
reads the window's positions, which span at most ceil((W - 1) / block) + 1 blocks. For
Gemma 2, blocks are counted in layers (a grouped block holds one group's layers): the
windowed layers' share (what the grouped pool holds beyond the full group's every block)
against the blocks the context spans, and the whole request's KV against one table.

    python -m bench.window_memory [--window 64] [--multiples 1,2,4,8] [--out ...]

JSON to bench/results/window_memory.json.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from bench.load_runs import bench_stack, pool_stats
from bench.report import machine_info, write_report
from common.model_config import ModelConfig
from devtools.checkpoint_builder import build_checkpoint
from tests.stack_client import BackgroundStream, frozen, greedy_request

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK = 16
STREAMED = 8  # tokens out before the freeze
MAX_TOKENS = 256  # far more than stream before the freeze: the request is surely running


def held_blocks(
    model: Path, contexts: list[int], max_model_len: int, flags: tuple[str, ...] = ()
) -> list[dict]:
    args = {"both": ["--max-model-len", str(max_model_len), "--block-size", str(BLOCK), *flags]}
    rows = []
    with bench_stack(model, args, "window-memory-", prefill=0, decode=0, both=1) as stack:
        worker = next(p.name for p in stack.processes if p.name.startswith("both-"))
        scheduler = stack.spec.scheduler_address
        for context in contexts:
            generator = torch.Generator().manual_seed(context)
            prompt = torch.randint(3, 1000, (context,), generator=generator).tolist()
            request = greedy_request(prompt, MAX_TOKENS)
            stream = BackgroundStream(stack.spec.gateway_address, request, 300.0)
            stream.wait_tokens(STREAMED)
            with frozen(stack, [worker]):
                pool = pool_stats(scheduler)
                if pool.num_requests != 1:
                    raise RuntimeError(f"the request is not running at the freeze: {pool}")
                held = pool.num_blocks - pool.num_free_blocks
                tokens = context + len(stream.token_ids)
            stream.result()
            rows.append({"context": context, "tokens_at_freeze": tokens, "held_blocks": held,
                         "spanned_blocks": -(-tokens // BLOCK)})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--multiples", default="1,2,4,8")
    parser.add_argument("--out", default=str(RESULTS / "window_memory.json"))
    args = parser.parse_args()
    window = args.window
    contexts = [m * window for m in map(int, args.multiples.split(","))]
    max_model_len = max(contexts) + MAX_TOKENS + BLOCK
    folder = Path(tempfile.mkdtemp(prefix="window-memory-ckpt-"))
    common = dict(max_position_embeddings=max_model_len, seed=7)
    models = {
        "windowed": build_checkpoint(folder / "windowed", "mistral", sliding_window=window,
                                     **common),
        "full": build_checkpoint(folder / "full", "mistral", sliding_window=None, **common),
    }  # fmt: skip
    held = {name: held_blocks(path, contexts, max_model_len) for name, path in models.items()}
    rows = []
    print(f"window {window} tokens, block {BLOCK}")
    print(f"{'context':>8} {'windowed':>9} {'full':>5} {'ratio':>6} {'ideal':>6}")
    for windowed, full in zip(held["windowed"], held["full"], strict=True):
        tokens = windowed["tokens_at_freeze"]
        ratio = windowed["held_blocks"] / full["held_blocks"]
        ideal = min(1.0, (window + BLOCK) / tokens)
        rows.append({**windowed, "full_held_blocks": full["held_blocks"],
                     "ratio": round(ratio, 3), "ideal_ratio": round(ideal, 3)})  # fmt: skip
        print(f"{windowed['context']:>8} {windowed['held_blocks']:>9} {full['held_blocks']:>5} "
              f"{ratio:>6.3f} {ideal:>6.3f}")  # fmt: skip
    hybrid = hybrid_rows(folder, window, contexts, max_model_len)
    out = write_report(
        args.out,
        {"bench": "window_memory", "window": window, "block_size": BLOCK, "rows": rows,
         "gemma2_kv_groups": hybrid, "machine": machine_info()},
    )  # fmt: skip
    print(f"wrote {out}")


GEMMA_LAYERS = 4  # sliding, full, sliding, full: two KV groups of two layers


def hybrid_rows(folder: Path, window: int, contexts: list[int], max_model_len: int) -> list:
    model = build_checkpoint(
        folder / "gemma2", "gemma2", num_hidden_layers=GEMMA_LAYERS, sliding_window=window,
        max_position_embeddings=max_model_len, seed=7,
    )  # fmt: skip
    groups = ModelConfig.from_folder(model).kv_groups()
    grouped = held_blocks(model, contexts, max_model_len)
    one_table = held_blocks(model, contexts, max_model_len, ("--disable-hybrid-kv-cache-manager",))
    full_groups = sum(1 for w in groups.windows if w is None)
    windowed_groups = groups.num_groups - full_groups
    rows = []
    print(f"gemma2, {GEMMA_LAYERS} layers in KV groups {groups.layers}, windows {groups.windows}")
    print(f"{'context':>8} {'grouped':>8} {'one table':>9} {'KV ratio':>8} {'windowed':>8} "
          f"{'ideal':>6}")  # fmt: skip
    for mine, theirs in zip(grouped, one_table, strict=True):
        spanned = mine["spanned_blocks"]
        layer_blocks = mine["held_blocks"] * groups.size
        one_table_layer_blocks = theirs["held_blocks"] * GEMMA_LAYERS
        per_windowed_group = (mine["held_blocks"] - full_groups * spanned) / windowed_groups
        windowed_ratio = per_windowed_group / spanned
        ideal = min(1.0, (window + BLOCK) / mine["tokens_at_freeze"])
        rows.append({
            **mine, "layer_blocks": layer_blocks,
            "one_table_held_blocks": theirs["held_blocks"],
            "one_table_layer_blocks": one_table_layer_blocks,
            "kv_ratio": round(layer_blocks / one_table_layer_blocks, 3),
            "windowed_group_blocks": per_windowed_group,
            "windowed_ratio": round(windowed_ratio, 3), "ideal_windowed_ratio": round(ideal, 3),
        })  # fmt: skip
        print(f"{mine['context']:>8} {layer_blocks:>8} {one_table_layer_blocks:>9} "
              f"{layer_blocks / one_table_layer_blocks:>8.3f} {windowed_ratio:>8.3f} "
              f"{ideal:>6.3f}")  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
