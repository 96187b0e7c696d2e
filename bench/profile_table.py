"""Two profiles (`bench/profile_serve.py` summaries) side by side as a Markdown table: where
each millisecond of a decode step goes, per process and component, before and after.

    python -m bench.profile_table bench/results/profiles/before bench/results/profiles/after
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# Rows of the table: (label, role of the process, categories summed). Roles: the process
# whose name starts with it ("prefill", "decode", "both", "scheduler", "gateway", "http",
# "client").
ROWS = (
    ("model: matmuls, norms, RoPE, activations (tensor thread)", "worker", ("model",)),
    ("model: torch intra-op threads (the matmuls' other half)", "worker", ("native threads",)),
    ("attention", "worker", ("attention",)),
    ("sampler", "worker", ("sampler",)),
    ("step inputs, batch bookkeeping", "worker", ("step inputs",)),
    ("worker event loop, gRPC, protobuf", "worker", ("event loop", "gRPC", "protobuf")),
    ("worker: KV transfer, lock waits, other Python", "worker", ("KV transfer", "other Python")),
    ("scheduler (bookkeeping, gRPC, event loop)", "scheduler", None),
    ("gateway (detokenization, stop strings, gRPC)", "gateway", None),
    ("HTTP front (SSE, JSON, gRPC)", "http", None),
    ("client: vllm bench serve", "client", None),
)


def _load(folder: str) -> dict:
    """A profile's summary, by folder or by label (under bench/results/profiles)."""
    path = Path(folder)
    if not path.is_dir():
        path = Path(__file__).resolve().parent / "results" / "profiles" / folder
    return json.loads((path / "summary.json").read_text())


def _role(service: str) -> str:
    for role in ("prefill", "decode", "both"):
        if service.startswith(role):
            return "worker"
    return service.split()[0].split("-")[0]


def _cell(summary: dict, role: str, categories: tuple[str, ...] | None) -> float:
    total = 0.0
    for row in summary["services"]:
        if _role(row["service"]) != role:
            continue
        if categories is None:
            total += row["cpu_ms_per_step"]
        else:
            total += sum(row["ms_per_step"].get(c, 0.0) for c in categories)
    return total


def markdown(before: dict, after: dict) -> str:
    head = (
        f"| CPU ms per decode step (c{before['load']['concurrency']}, {before['model']}) "
        f"| {before['label']} | {after['label']} |"
    )
    lines = [head, "|---|---:|---:|"]
    for label, role, categories in ROWS:
        lines.append(
            f"| {label} | {_cell(before, role, categories):.1f} "
            f"| {_cell(after, role, categories):.1f} |"
        )

    def waiting(summary: dict) -> float:
        return sum(row["waiting_ms_per_step"] for row in summary["services"])

    def total(summary: dict) -> float:
        return sum(row["cpu_ms_per_step"] for row in summary["services"])

    lines += [
        f"| **CPU, all processes** | **{total(before):.1f}** | **{total(after):.1f}** |",
        f"| waiting for a core (runnable, not running; all threads) | {waiting(before):.1f} "
        f"| {waiting(after):.1f} |",
        f"| **decode step interval (wall)** | **{before['step_interval_ms']:.1f}** "
        f"| **{after['step_interval_ms']:.1f}** |",
        f"| decode worker execute time per step (wall) | {before['execute_ms']:.1f} "
        f"| {after['execute_ms']:.1f} |",
        f"| output tok/s during the profile | {before['result']['output_throughput']:.0f} "
        f"| {after['result']['output_throughput']:.0f} |",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_table", description=__doc__)
    parser.add_argument("before")
    parser.add_argument("after")
    args = parser.parse_args(argv)
    print(markdown(_load(args.before), _load(args.after)))


if __name__ == "__main__":
    main()
