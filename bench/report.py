"""The serving benchmark's report: machine info, ratios, the stdout table and the optional
PNG plot."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import grpc
import torch

from bench.metrics import RequestRecord, ttft_s


def load_average() -> float | None:
    """1-minute load average (other work on the machine skews every number here)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def write_report(path: str | Path, report: dict) -> Path:
    """Write a benchmark's JSON report (folders made as needed); returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return out


def machine_info() -> dict:
    import transformers

    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "grpcio": grpc.__version__,
    }


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, 3)


def prefix_cache_comparison(on: dict, off: dict) -> dict:
    """TTFT with prefix caching on and off, and off / on (> 1: the cache helps)."""
    keys = ("mean", "p50", "p90", "p99")
    return {
        "ttft_ms_on": on["ttft_ms"],
        "ttft_ms_off": off["ttft_ms"],
        "ttft_ratio_off_over_on": {k: _ratio(off["ttft_ms"][k], on["ttft_ms"][k]) for k in keys},
        "prefix_cache_hit_rate_on": on["prefix_cache_hit_rate"],
        "prefix_cache_hit_rate_off": off["prefix_cache_hit_rate"],
        "output_tokens_per_s_on": on["output_tokens_per_s"],
        "output_tokens_per_s_off": off["output_tokens_per_s"],
    }


def sampling_comparison(greedy: dict, full: dict) -> dict:
    """Throughput and latency with every sampling feature on, against greedy (full / greedy;
    < 1 for throughput: what the features cost)."""
    keys = ("mean", "p50", "p99")
    return {
        "output_tokens_per_s_greedy": greedy["output_tokens_per_s"],
        "output_tokens_per_s_full": full["output_tokens_per_s"],
        "throughput_ratio_full_over_greedy": _ratio(
            full["output_tokens_per_s"], greedy["output_tokens_per_s"]
        ),
        "tpot_ratio_full_over_greedy": {
            k: _ratio(full["tpot_ms"][k], greedy["tpot_ms"][k]) for k in keys
        },
        "ttft_ratio_full_over_greedy": {
            k: _ratio(full["ttft_ms"][k], greedy["ttft_ms"][k]) for k in keys
        },
    }


def hf_ratios(tandem: dict, hf: dict) -> dict:
    return {
        key: _ratio(tandem[key], hf[key])
        for key in ("output_tokens_per_s", "total_tokens_per_s", "requests_per_s")
    }


def _fmt(value: float | int | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}f}"


def format_table(report: dict) -> str:
    """The report's main numbers, one column per run (the HF column: throughput only)."""
    runs = {label: run for label, run in report["tandem"].items()}
    hf = report.get("hf_baseline")
    columns = [*runs, *(["hf_generate"] if hf else [])]
    rows: list[tuple[str, list[str]]] = []

    def add(name: str, key: str, digits: int = 1, from_hf: bool = False) -> None:
        cells = [_fmt(run.get(key), digits) for run in runs.values()]
        if hf:
            cells.append(_fmt(hf.get(key), digits) if from_hf else "")
        rows.append((name, cells))

    add("completed", "completed", from_hf=False)
    add("failed", "failed")
    add("wall s", "wall_s", 2, from_hf=True)
    add("requests/s", "requests_per_s", 2, from_hf=True)
    add("output tokens/s", "output_tokens_per_s", 1, from_hf=True)
    add("total tokens/s", "total_tokens_per_s", 1, from_hf=True)
    add("prefix-cache hit rate", "prefix_cache_hit_rate", 3)
    for metric, title in (
        ("ttft_ms", "TTFT ms"),
        ("itl_ms", "ITL ms"),
        ("tpot_ms", "TPOT ms"),
        ("e2e_latency_ms", "E2E ms"),
    ):
        for stat in ("mean", "p50", "p90", "p99"):
            cells = [_fmt(run[metric][stat], 2) for run in runs.values()]
            rows.append((f"{title} {stat}", cells + ([""] if hf else [])))
    width = max(len(name) for name, _ in rows)
    cell = max(12, *(len(c) for c in columns))
    lines = [" " * width + "  " + "  ".join(c.rjust(cell) for c in columns)]
    lines += [name.ljust(width) + "  " + "  ".join(c.rjust(cell) for c in cs) for name, cs in rows]
    return "\n".join(lines)


def summary_lines(report: dict) -> list[str]:
    lines = []
    if report.get("ratio_tandem_over_hf"):
        ratio = report["ratio_tandem_over_hf"]
        lines.append(
            f"Tandem / HF generate: output tokens/s x{_fmt(ratio['output_tokens_per_s'], 2)}, "
            f"total tokens/s x{_fmt(ratio['total_tokens_per_s'], 2)}"
        )
    comparison = report.get("prefix_cache_comparison")
    if comparison:
        on, off = comparison["ttft_ms_on"], comparison["ttft_ms_off"]
        ratio = comparison["ttft_ratio_off_over_on"]
        lines.append(
            f"TTFT prefix cache on: mean {_fmt(on['mean'], 2)} ms, p50 {_fmt(on['p50'], 2)} ms;"
            f" off: mean {_fmt(off['mean'], 2)} ms, p50 {_fmt(off['p50'], 2)} ms;"
            f" off/on x{_fmt(ratio['mean'], 2)} (mean), x{_fmt(ratio['p50'], 2)} (p50)"
        )
    sampling = report.get("sampling_comparison")
    if sampling:
        lines.append(
            f"Full sampling / greedy: output tokens/s "
            f"x{_fmt(sampling['throughput_ratio_full_over_greedy'], 2)}, TPOT p50 "
            f"x{_fmt(sampling['tpot_ratio_full_over_greedy']['p50'], 2)}, TTFT p50 "
            f"x{_fmt(sampling['ttft_ratio_full_over_greedy']['p50'], 2)}"
        )
    return lines


def write_plot(path: str, runs: dict[str, list[RequestRecord]], report: dict) -> str:
    """TTFT CDF, E2E latency by prompt length, and throughput bars; returns a message."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"--plot {path}: matplotlib is not installed (pip install matplotlib); no plot"
    fig, (cdf, scatter, bars) = plt.subplots(1, 3, figsize=(15, 4.5))
    for label, records in runs.items():
        ttfts = sorted(t * 1e3 for r in records if r.ok and (t := ttft_s(r)) is not None)
        fractions = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
        cdf.step(ttfts, fractions, where="post", label=label)
        done = [r for r in records if r.ok]
        scatter.scatter(
            [r.prompt_tokens for r in done],
            [(r.end_s - r.send_s) * 1e3 for r in done],
            s=10,
            label=label,
        )
    cdf.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF")
    scatter.set(xlabel="prompt tokens", ylabel="end-to-end latency (ms)", title="E2E latency")
    throughput = {label: run["output_tokens_per_s"] for label, run in report["tandem"].items()}
    if report.get("hf_baseline"):
        throughput["hf_generate"] = report["hf_baseline"]["output_tokens_per_s"]
    bars.bar(list(throughput), [v or 0 for v in throughput.values()])
    bars.set(ylabel="output tokens/s", title="Throughput")
    cdf.legend()
    scatter.legend()
    fig.suptitle(f"bench.serve {report['workload']['name']} ({report['model']['name']})")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"
