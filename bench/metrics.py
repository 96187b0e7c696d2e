"""Serving metrics of the benchmark (`bench/serve.py`), computed from per-request records.

Pure functions over `RequestRecord`s (times in seconds from the start of the run, as the
client saw them). Definitions:

- TTFT: first message carrying tokens minus send time.
- ITL (inter-token latency), per token arrival: a stream message carrying k tokens that
  arrives g seconds after the previous token-carrying message contributes k samples of g / k,
  so a message that batches several tokens counts as that many evenly spaced tokens. Tokens
  that came in the first message have no predecessor and contribute no sample.
- TPOT (time per output token): per request, (last token time - first token time) /
  (output tokens - 1); requests with a single output token have none.
- E2E latency: end of the stream minus send time.
- Each latency is summarised by mean / p50 / p90 / p99 over its samples (percentiles by
  linear interpolation between closest ranks, as numpy's default), in milliseconds.
- Throughput over the run's wall time (first send to last stream end): output tokens/s,
  total (prompt + output) tokens/s and requests/s, counting successful requests and the
  tokens actually received (random models may stop at EOS before max_tokens).
- Prefix-cache hit rate: sum of `usage.cached_tokens` / sum of prompt tokens.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """What the client saw of one request."""

    index: int
    prompt_tokens: int
    max_tokens: int
    send_s: float = 0.0
    message_s: list[float] = field(default_factory=list)  # token-carrying messages only
    message_tokens: list[int] = field(default_factory=list)  # tokens in each of them
    end_s: float | None = None
    cached_tokens: int = 0
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    draft_tokens: int = 0  # speculative decoding: proposed, and accepted of those
    accepted_tokens: int = 0
    finish_reason: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_s is not None

    @property
    def output_tokens(self) -> int:
        return sum(self.message_tokens)

    @property
    def served_prompt_tokens(self) -> int:
        """The server's prompt count when it reported one, else what was sent."""
        return self.prompt_tokens if self.usage_prompt_tokens is None else self.usage_prompt_tokens


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution_ms(values_s: Sequence[float]) -> dict[str, float | int | None]:
    """count, mean and percentiles of a list of seconds, in milliseconds."""
    if not values_s:
        return {"count": 0, "mean": None, **{f"p{q}": None for q in PERCENTILES}}
    out: dict[str, float | int | None] = {
        "count": len(values_s),
        "mean": round(sum(values_s) / len(values_s) * 1e3, 3),
    }
    for q in PERCENTILES:
        out[f"p{q}"] = round(percentile(values_s, q) * 1e3, 3)
    return out


def ttft_s(record: RequestRecord) -> float | None:
    return record.message_s[0] - record.send_s if record.message_s else None


def itl_samples_s(record: RequestRecord) -> list[float]:
    """Inter-token latencies of one request, normalised per token (see module docstring)."""
    samples: list[float] = []
    pairs = zip(record.message_s, record.message_s[1:], record.message_tokens[1:], strict=False)
    for previous, current, tokens in pairs:
        if tokens > 0:
            samples.extend([(current - previous) / tokens] * tokens)
    return samples


def tpot_s(record: RequestRecord) -> float | None:
    if record.output_tokens < 2:
        return None
    return (record.message_s[-1] - record.message_s[0]) / (record.output_tokens - 1)


def e2e_s(record: RequestRecord) -> float | None:
    return None if record.end_s is None else record.end_s - record.send_s


def _present(values: Iterable[float | None]) -> list[float]:
    return [v for v in values if v is not None]


def prefix_cache_hit_rate(records: Iterable[RequestRecord]) -> float | None:
    """Prompt tokens served from the prefix cache / all prompt tokens (successful requests)."""
    done = [r for r in records if r.ok]
    prompt = sum(r.served_prompt_tokens for r in done)
    return None if prompt == 0 else sum(r.cached_tokens for r in done) / prompt


def error_counts(records: Iterable[RequestRecord]) -> dict[str, int]:
    return dict(Counter(r.error or "stream ended without a finish" for r in records if not r.ok))


def summarize(records: Sequence[RequestRecord], wall_s: float) -> dict:
    """Every metric of one run (see the module docstring for the definitions)."""
    done = [r for r in records if r.ok]
    output = sum(r.output_tokens for r in done)
    prompt = sum(r.served_prompt_tokens for r in done)
    hit_rate = prefix_cache_hit_rate(done)
    per_second = (lambda n: round(n / wall_s, 3)) if wall_s > 0 else (lambda n: None)
    return {
        "requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": error_counts(records),
        "stopped_before_max_tokens": sum(1 for r in done if r.output_tokens < r.max_tokens),
        "wall_s": round(wall_s, 3),
        "prompt_tokens": prompt,
        "output_tokens": output,
        "cached_tokens": sum(r.cached_tokens for r in done),
        "prefix_cache_hit_rate": None if hit_rate is None else round(hit_rate, 4),
        "output_tokens_per_s": per_second(output),
        "total_tokens_per_s": per_second(prompt + output),
        "requests_per_s": per_second(len(done)),
        "ttft_ms": distribution_ms(_present(ttft_s(r) for r in done)),
        "itl_ms": distribution_ms([s for r in done for s in itl_samples_s(r)]),
        "tpot_ms": distribution_ms(_present(tpot_s(r) for r in done)),
        "e2e_latency_ms": distribution_ms(_present(e2e_s(r) for r in done)),
    }


def per_request_rows(records: Sequence[RequestRecord]) -> list[dict]:
    """A compact row per request for the JSON (and plots): lengths, cache hits, latencies."""

    def ms(value: float | None) -> float | None:
        return None if value is None else round(value * 1e3, 3)

    return [
        {
            "index": r.index,
            "prompt_tokens": r.prompt_tokens,
            "max_tokens": r.max_tokens,
            "output_tokens": r.output_tokens,
            "cached_tokens": r.cached_tokens,
            "finish_reason": r.finish_reason,
            "send_ms": ms(r.send_s),
            "ttft_ms": ms(ttft_s(r)),
            "tpot_ms": ms(tpot_s(r)),
            "e2e_ms": ms(e2e_s(r)),
            "error": r.error,
        }
        for r in records
    ]
