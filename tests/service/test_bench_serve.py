"""The serving benchmark (`bench/serve.py`): its metrics and workloads as pure functions, its
CLI, and one end-to-end run against a real stack on the tiny test checkpoint."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bench.hf_baseline import _row_tokens
from bench.metrics import (
    RequestRecord,
    distribution_ms,
    itl_samples_s,
    percentile,
    prefix_cache_hit_rate,
    summarize,
    tpot_s,
    ttft_s,
)
from bench.report import format_table
from bench.serve import BenchConfig, parse_args, run_benchmark, tandem_runs
from bench.serve_client import FULL_LOGPROBS, FULL_STOP, make_request
from bench.workloads import (
    BenchRequest,
    MixedParams,
    SharedPrefixParams,
    arrival_offsets,
    check_fits,
    mixed,
    shared_prefix,
    usable_token_ids,
)
from services.gateway.validation import ModelLimits, validate_sampling, validate_stopping

SPECIAL = (0, 1, 2)
VOCAB = list(range(3, 300))


@dataclass
class FakeTokenizer:
    size: int = 300
    all_special_ids: list[int] = field(default_factory=lambda: list(SPECIAL))

    def __len__(self) -> int:
        return self.size


def record(
    times: list[float], tokens: list[int], send: float = 0.0, end: float | None = None, **kw
) -> RequestRecord:
    return RequestRecord(
        index=kw.pop("index", 0),
        prompt_tokens=kw.pop("prompt_tokens", 10),
        max_tokens=kw.pop("max_tokens", sum(tokens)),
        send_s=send,
        message_s=times,
        message_tokens=tokens,
        end_s=(times[-1] if times else send) if end is None else end,
        **kw,
    )


# -- metrics -------------------------------------------------------------------------------


def test_percentile_interpolates_between_closest_ranks():
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([1, 2, 3, 4], 0) == 1
    assert percentile([1, 2, 3, 4], 100) == 4
    assert percentile(list(range(1, 11)), 90) == pytest.approx(9.1)
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1], 101)


def test_distribution_is_in_ms_and_ordered():
    values = [0.001 * i for i in range(1, 101)]
    dist = distribution_ms(values)
    assert dist["count"] == 100
    assert dist["mean"] == pytest.approx(50.5)
    assert dist["p50"] <= dist["p90"] <= dist["p99"] <= 100
    assert distribution_ms([]) == {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None}


def test_itl_is_normalised_per_token():
    r = record([1.0, 1.1, 1.4], [1, 1, 3], send=0.5)
    assert ttft_s(r) == pytest.approx(0.5)
    assert itl_samples_s(r) == pytest.approx([0.1, 0.1, 0.1, 0.1])
    assert tpot_s(r) == pytest.approx(0.4 / 4)
    # Tokens of the first message have no predecessor: no ITL sample for them.
    r = record([1.0, 1.2], [3, 2])
    assert itl_samples_s(r) == pytest.approx([0.1, 0.1])
    assert tpot_s(record([1.0], [1])) is None
    assert itl_samples_s(record([1.0], [1])) == []


def test_hit_rate_uses_successful_requests_and_server_prompt_counts():
    records = [
        record([1.0], [1], prompt_tokens=100, cached_tokens=64),
        record([1.0], [1], prompt_tokens=90, usage_prompt_tokens=100, cached_tokens=32),
        record([], [], prompt_tokens=100, cached_tokens=100, error="UNAVAILABLE: down"),
    ]
    assert prefix_cache_hit_rate(records) == pytest.approx(96 / 200)
    assert prefix_cache_hit_rate([record([1.0], [1], prompt_tokens=0)]) is None


def test_summarize_counts_failures_and_throughput():
    records = [
        record([0.5, 1.0], [1, 3], send=0.0, end=1.0, index=0, prompt_tokens=10, max_tokens=8),
        record([1.5, 2.0], [1, 1], send=1.0, end=2.0, index=1, prompt_tokens=20, max_tokens=2),
        record([], [], send=1.0, index=2, error="INTERNAL: boom"),
    ]
    summary = summarize(records, wall_s=2.0)
    assert (summary["completed"], summary["failed"]) == (2, 1)
    assert summary["errors"] == {"INTERNAL: boom": 1}
    assert summary["output_tokens"] == 6
    assert summary["output_tokens_per_s"] == 3.0
    assert summary["total_tokens_per_s"] == 18.0
    assert summary["requests_per_s"] == 1.0
    assert summary["stopped_before_max_tokens"] == 1
    assert summary["ttft_ms"]["mean"] == pytest.approx(500.0)
    assert summary["e2e_latency_ms"]["p50"] == pytest.approx(1000.0)
    assert summary["itl_ms"]["count"] == 4


# -- workloads -----------------------------------------------------------------------------


def test_usable_token_ids_skip_special_tokens_and_respect_vocab_size():
    ids = usable_token_ids(FakeTokenizer(size=10))
    assert ids == list(range(3, 10))
    assert usable_token_ids(FakeTokenizer(size=10), vocab_size=5) == [3, 4]


def test_mixed_is_deterministic_and_within_bounds():
    params = MixedParams(num_requests=300, prompt_len_range=(16, 200), output_len_range=(4, 40))
    first, again = mixed(VOCAB, params, seed=7), mixed(VOCAB, params, seed=7)
    assert first == again
    assert first != mixed(VOCAB, params, seed=8)
    assert [r.index for r in first] == list(range(300))
    for r in first:
        assert 16 <= len(r.prompt_ids) <= 200
        assert 4 <= r.max_tokens <= 40
        assert not set(r.prompt_ids) & set(SPECIAL)
    lengths = [len(r.prompt_ids) for r in first]
    assert len(set(lengths)) > 20  # a distribution, not a constant


def test_shared_prefix_groups_share_their_prefix_and_interleave():
    params = SharedPrefixParams(
        num_requests=12, num_groups=3, prefix_len=48, suffix_len_range=(4, 8)
    )
    requests = shared_prefix(VOCAB, params, seed=1)
    assert requests == shared_prefix(VOCAB, params, seed=1)
    assert [r.group for r in requests] == [i % 3 for i in range(12)]
    prefixes = {}
    for r in requests:
        assert 48 + 4 <= len(r.prompt_ids) <= 48 + 8
        assert 16 <= r.max_tokens <= 32
        assert not set(r.prompt_ids) & set(SPECIAL)
        prefixes.setdefault(r.group, set()).add(r.prompt_ids[:48])
    assert all(len(p) == 1 for p in prefixes.values())  # one prefix per group
    assert len({next(iter(p)) for p in prefixes.values()}) == 3  # distinct across groups
    suffixes = [r.prompt_ids[48:] for r in requests]
    assert len(set(suffixes)) == len(suffixes)


def test_check_fits_rejects_requests_longer_than_the_context():
    check_fits([BenchRequest(0, (5,) * 10, 6)], max_model_len=16)
    with pytest.raises(ValueError, match="exceed the context of 16"):
        check_fits([BenchRequest(0, (5,) * 10, 7)], max_model_len=16)


def test_arrival_offsets_are_poisson_and_deterministic():
    assert arrival_offsets(4, math.inf, seed=0) == [0.0] * 4
    offsets = arrival_offsets(2000, 10.0, seed=3)
    assert offsets == arrival_offsets(2000, 10.0, seed=3)
    assert offsets[0] == 0.0
    assert all(b >= a for a, b in zip(offsets, offsets[1:], strict=False))
    assert offsets[-1] / 1999 == pytest.approx(0.1, rel=0.1)  # mean gap 1 / rate
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0, seed=0)


# -- CLI and helpers -----------------------------------------------------------------------


def test_cli_parses_load_options():
    config = parse_args(["--workload", "shared-prefix", "--request-rate", "inf"])
    assert config.request_rate == math.inf and config.effective_concurrency is None
    assert config.hf_batch_size == 8
    config = parse_args(["--concurrency", "4", "--no-hf-baseline", "--output-len", "2", "9"])
    assert (config.effective_concurrency, config.hf_baseline, config.output_len) == (
        4,
        False,
        (2, 9),
    )
    assert parse_args([]).effective_concurrency == 8
    for bad in (
        ["--request-rate", "2", "--concurrency", "2"],
        ["--request-rate", "0"],
        ["--address", "127.0.0.1:1", "--compare-prefix-cache"],
        ["--both", "1", "--prefill", "2"],
        ["--sampling", "beam"],
        ["--compare-sampling", "--compare-prefix-cache"],
    ):
        with pytest.raises(SystemExit):
            parse_args(bad)
    config = parse_args(["--compare-sampling"])
    assert config.compare_sampling and config.sampling == "greedy"
    assert [(label, mode) for label, _, mode in tandem_runs(config)] == [
        ("greedy", "greedy"),
        ("full_sampling", "full"),
    ]
    assert [mode for _, _, mode in tandem_runs(parse_args(["--sampling", "full"]))] == ["full"]


def test_full_sampling_requests_use_every_feature_and_pass_the_gateways_validation():
    request = BenchRequest(3, (17, 18, 19), 12)
    greedy = make_request(request, "", "greedy")
    assert greedy.sampling.temperature == 0 and not greedy.HasField("logprobs")
    full = make_request(request, "salt", "full")
    limits = ModelLimits(vocab_size=64, max_model_len=64, default_max_tokens=16)
    sampling = validate_sampling(full.sampling, limits)
    assert sampling.seed == 3 and sampling.logit_bias == ((17, -1.0),)
    assert sampling.top_k and sampling.top_p < 1 and sampling.min_p > 0
    assert sampling.repetition_penalty != 1 and sampling.presence_penalty != 0
    assert validate_stopping(full.stopping, limits, full.max_tokens).stop == (FULL_STOP,)
    assert full.logprobs == FULL_LOGPROBS and full.cache_salt == "salt"


def test_hf_row_tokens_stop_at_eos():
    assert _row_tokens([5, 6, 1, 2, 2], {1}) == 3
    assert _row_tokens([5, 6, 7], {1}) == 3


# -- end to end ----------------------------------------------------------------------------


def test_serve_benchmark_end_to_end(tiny_llama_dir: Path, tmp_path: Path):
    """Shared-prefix workload on two real stacks (prefix caching on, off) plus HF baseline."""
    out = tmp_path / "serve.json"
    config = BenchConfig(
        model=str(tiny_llama_dir),
        workload="shared-prefix",
        num_requests=6,
        concurrency=2,
        num_groups=2,
        prefix_len=48,
        suffix_len=(4, 16),
        output_len=(4, 16),
        compare_prefix_cache=True,
        out=str(out),
        run_dir=str(tmp_path / "stacks"),
        ready_timeout_s=120,
        request_timeout_s=60,
        progress=False,
    )
    report = run_benchmark(config)
    assert json.loads(out.read_text())["tandem"].keys() == report["tandem"].keys()
    for label in ("prefix_cache_on", "prefix_cache_off"):
        run = report["tandem"][label]
        assert (run["completed"], run["failed"]) == (6, 0), run["errors"]
        assert run["output_tokens"] > 0 and run["output_tokens_per_s"] > 0
        assert run["total_tokens_per_s"] > run["output_tokens_per_s"]
        for metric in ("ttft_ms", "tpot_ms", "e2e_latency_ms"):
            dist = run[metric]
            assert 0 < dist["p50"] <= dist["p90"] <= dist["p99"], (label, metric, dist)
        assert run["ttft_ms"]["p99"] <= run["e2e_latency_ms"]["p99"]
        assert len(run["per_request"]) == 6
    assert report["tandem"]["prefix_cache_off"]["prefix_cache_hit_rate"] == 0
    comparison = report["prefix_cache_comparison"]
    assert comparison["ttft_ratio_off_over_on"]["mean"] > 0
    hf = report["hf_baseline"]
    assert hf["output_tokens"] > 0 and hf["output_tokens_per_s"] > 0
    assert hf["output_tokens"] <= report["tandem"]["prefix_cache_on"]["output_tokens"]
    assert report["ratio_tandem_over_hf"]["output_tokens_per_s"] > 0
    assert report["machine"]["cpus"] and report["workload"]["num_requests"] == 6
    assert "TTFT ms p99" in format_table(report)
