"""Prometheus metrics of a live stack: every service scraped after a known set of requests
(two sharing a prompt prefix, one with n=2, one through the HTTP front, three refused), each
number checked against what was sent, what the client saw, and `GetPoolStats`; and the
Grafana dashboard's PromQL only names metrics the stack exports."""

from __future__ import annotations

import json
import re
import urllib.request
from collections import defaultdict
from pathlib import Path

import grpc
import pytest

from common.pb.tandem.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from common.pb.tandem.v1 import generate_pb2, generate_pb2_grpc
from common.sampling_pb import ROLE_FROM_PB
from tests.stack_client import greedy_request, pool_stats, scrape, total, wait_until_idle

API_KEY = "metrics-test-key"
DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "tandem-dashboard.json"
PREFIX = list(range(10, 50))  # 40 tokens: two full 16-token blocks to share


def by_label(samples: dict, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for (n, items), value in samples.items():
        if n == name:
            out[dict(items)[label]] += value
    return out


@pytest.fixture(scope="module")
def stack(module_stacks):
    return module_stacks(
        name="metrics",
        http=True,
        metrics=True,
        extra_args={
            "gateway": ["--api-key", API_KEY],
            # The n=2 request fits the queue; an n=3 one is refused as queue full.
            "scheduler": ["--max-waiting-requests", "2"],
        },
    )


def _stream(stub, request) -> list[generate_pb2.GenerateResponse]:
    return list(stub.Generate(request, metadata=[("authorization", f"Bearer {API_KEY}")]))


@pytest.fixture(scope="module")
def sent(stack):
    """Send the known requests; returns what the clients saw."""
    prompts = [PREFIX + [60, 61], PREFIX + [62, 63]]
    requests = [greedy_request(p, 6) for p in prompts]
    sampled = generate_pb2.GenerateRequest(text="Once upon a time", max_tokens=4, n=2)
    sampled.sampling.seed = 7
    requests.append(sampled)
    with grpc.insecure_channel(stack.spec.gateway_address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        streams = [_stream(stub, r) for r in requests]  # one after another: the prefix is cached
        too_long = greedy_request(PREFIX, 10**6)
        with pytest.raises(grpc.RpcError) as invalid:
            _stream(stub, too_long)
        assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        too_many = generate_pb2.GenerateRequest(text="Once upon a time", max_tokens=4, n=3)
        with pytest.raises(grpc.RpcError) as queue_full:
            _stream(stub, too_many)
        assert queue_full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as unauthenticated:
            list(stub.Generate(requests[0]))
        assert unauthenticated.value.code() == grpc.StatusCode.UNAUTHENTICATED
    body = json.dumps({"prompt": [1, 2, 3, 4, 5], "max_tokens": 1, "model": model_name(stack)})
    http = urllib.request.Request(
        f"http://{stack.spec.http_address}/v1/completions",
        data=body.encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
    )
    with urllib.request.urlopen(http, timeout=60) as response:
        completion = json.loads(response.read())
    wait_until_idle(stack)
    return streams, completion


def model_name(stack) -> str:
    with grpc.insecure_channel(stack.spec.scheduler_address) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        return stub.GetModelInfo(scheduler_pb2.GetModelInfoRequest(), timeout=10).model.name


def scrape_all(stack) -> dict[str, dict]:
    return {p.name: scrape(p.metrics) for p in stack.processes}


def test_gateway_metrics_match_what_the_clients_saw(stack, sent):
    streams, completion = sent
    g = scrape_all(stack)["gateway"]
    lasts = [stream[-1] for stream in streams]
    prompt = sum(m.usage.prompt_tokens for m in lasts) + completion["usage"]["prompt_tokens"]
    generated = sum(m.usage.completion_tokens for m in lasts)
    generated += completion["usage"]["completion_tokens"]
    assert total(g, "tandem:prompt_tokens_total") == prompt
    assert total(g, "tandem:generation_tokens_total") == generated
    # One finish per sample: 1 + 1 + 2 over gRPC, 1 over HTTP.
    reasons: dict[str, float] = defaultdict(float)
    names = {generate_pb2.FINISH_REASON_STOP: "stop", generate_pb2.FINISH_REASON_LENGTH: "length"}
    for stream in streams:
        for m in stream:
            if m.finish_reason:
                reasons[names[m.finish_reason]] += 1
    reasons[completion["choices"][0]["finish_reason"]] += 1
    success = by_label(g, "tandem:request_success_total", "finished_reason")
    assert {k: v for k, v in success.items() if v} == reasons
    # Histograms: one TTFT and e2e per request, sums equal to the timings clients got.
    assert total(g, "tandem:time_to_first_token_seconds_count") == 4
    assert total(g, "tandem:e2e_request_latency_seconds_count") == 4
    grpc_ttft = sum(m.timings.ttft_ms for m in lasts) / 1e3
    assert grpc_ttft <= total(g, "tandem:time_to_first_token_seconds_sum") < grpc_ttft + 60
    # ITL: one per later message with tokens of each sample (the HTTP one made 1 token).
    with_tokens: dict[tuple[int, int], int] = defaultdict(int)
    for i, stream in enumerate(streams):
        for m in stream:
            with_tokens[i, m.index] += bool(m.token_ids)
    assert total(g, "tandem:inter_token_latency_seconds_count") == sum(
        c - 1 for c in with_tokens.values() if c
    )
    rejected = by_label(g, "tandem:request_rejected_total", "reason")
    assert rejected == {"invalid_argument": 1, "unauthenticated": 1, "resource_exhausted": 1}


def test_scheduler_metrics_match_pool_stats(stack, sent):
    streams, completion = sent
    stats = pool_stats(stack)
    s = scrape_all(stack)["scheduler"]
    model = {"model_name": model_name(stack)}
    assert total(s, "tandem:prefix_cache_hits_total") == sum(
        p.prefix_hit_tokens for p in stats.pools
    )
    assert total(s, "tandem:prefix_cache_hits_total") >= 32  # the second prompt's two blocks
    # Every sample looked the cache up once with its whole prompt (nothing was recomputed).
    per_sample = [m.usage.prompt_tokens for m in (st[-1] for st in streams[:2])]
    per_sample += [streams[2][-1].usage.prompt_tokens] * 2 + [completion["usage"]["prompt_tokens"]]
    assert total(s, "tandem:prefix_cache_queries_total") == sum(per_sample)
    assert total(s, "tandem:num_preemptions_total") == sum(p.preemptions for p in stats.pools)
    assert total(s, "tandem:worker_failures_total", **model) == stats.worker_failures
    assert total(s, "tandem:restarted_requests_total", **model) == stats.restarted_requests
    assert total(s, "tandem:queue_rejections_total", **model) == stats.rejected_requests == 1
    for p in stats.pools:
        pool = {"worker_id": p.worker_id, **model}
        usage = total(s, "tandem:kv_cache_usage_perc", **pool)
        assert 0.0 <= usage <= 1.0
        assert usage == pytest.approx((p.num_blocks - p.num_free_blocks) / p.num_blocks)
        assert total(s, "tandem:kv_cache_num_blocks", **pool) == p.num_blocks
        assert total(s, "tandem:spec_decode_num_draft_tokens_total", **pool) == (
            p.spec_decode_num_draft_tokens
        )
        assert total(s, "tandem:kv_transfers_total", **pool) == p.kv_transfers
        for state in ("running", "waiting", "swapped"):  # idle now
            assert total(s, f"tandem:num_requests_{state}", **pool) == 0
    # Per-request times: one per sample (5), each scheduled and given a first token.
    for short in ("queue", "prefill", "decode", "inference"):
        assert total(s, f"tandem:request_{short}_time_seconds_count", **model) == 5
    assert total(s, "tandem:lora_requests_info", max_lora="0", running_lora_adapters="") > 0


def test_worker_metrics_count_steps_and_kv_moved(stack, sent):
    stats = {p.worker_id: p for p in pool_stats(stack).pools}
    scraped = scrape_all(stack)
    for name, pool in stats.items():
        w = scraped[name]
        labels = {"worker_id": name, "role": ROLE_FROM_PB[pool.role]}
        assert total(w, "tandem:worker_step_execute_seconds_count", **labels) == pool.steps
    decode = next(n for n, p in stats.items() if n.startswith("decode"))
    received = total(scraped[decode], "tandem:kv_transfer_bytes_total")
    assert received > 0 and stats[decode].kv_blocks_received > 0
    assert total(scraped[decode], "tandem:kv_transfer_failures_total") == 0
    # A transfer given up because its request ended is counted apart, never as a failure.
    cancelled = by_label(scraped[decode], "tandem:kv_transfer_cancellations_total", "direction")
    assert set(cancelled) == {"send", "receive", "pull"}


def test_http_front_serves_metrics_on_its_own_port(stack, sent):
    h = scrape(stack.spec.http_address)
    assert total(h, "tandem:http_requests_total", handler="/v1/completions", status="200") == 1
    assert total(h, "tandem:http_request_duration_seconds_count", handler="/v1/completions") == 1


def test_dashboard_names_only_exported_metrics(stack, sent):
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [
        target["expr"]
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
        if "expr" in target
    ]
    assert len(exprs) >= 10
    referenced = {n for e in exprs for n in re.findall(r"tandem:[a-z0-9_]+", e)}
    exported = {name for samples in scrape_all(stack).values() for name, _ in samples}
    assert referenced and referenced <= exported, sorted(referenced - exported)
