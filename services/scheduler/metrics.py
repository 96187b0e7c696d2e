"""The scheduler's Prometheus metrics.

Per pool (labels `model_name`, `worker_id`, `role`) and per engine, computed at scrape time
on the engine's loop from the numbers `GetPoolStats` reports (`pool_families`: nothing on
the serving path); per pool and medium, the KV events published (`kv_event_families`, from
the hub's tallies); per request, the time histograms (`RequestTimes.observe`, once when a
request finishes). Names and meanings follow vLLM's (`vllm:` becomes `tandem:`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from common.metrics import REQUEST_LATENCY_BUCKETS, name
from services.scheduler.kv_event_hub import KvEventHub
from services.scheduler.request import Request

POOL_LABELS = ("model_name", "worker_id", "role")


def _histogram(short: str, help: str) -> Histogram:
    return Histogram(name(short), help, ["model_name"], buckets=REQUEST_LATENCY_BUCKETS)


QUEUE_TIME = _histogram(
    "request_queue_time_seconds", "time from arrival at the scheduler to first scheduled"
)
PREFILL_TIME = _histogram(
    "request_prefill_time_seconds", "time from first scheduled to the first token"
)
DECODE_TIME = _histogram("request_decode_time_seconds", "time from the first token to finish")
INFERENCE_TIME = _histogram("request_inference_time_seconds", "time from first scheduled to finish")


class RequestTimes:
    """The per-request time histograms of one model (the engine's `on_finish` hook)."""

    def __init__(self, model_name: str) -> None:
        self._queue = QUEUE_TIME.labels(model_name)
        self._prefill = PREFILL_TIME.labels(model_name)
        self._decode = DECODE_TIME.labels(model_name)
        self._inference = INFERENCE_TIME.labels(model_name)

    def observe(self, request: Request, now: float) -> None:
        """A finished request's times (those it reached: an abort while queued has none)."""
        scheduled, first = request.first_scheduled_time, request.first_token_time
        if scheduled is None:
            return
        self._queue.observe(max(0.0, scheduled - request.arrival_time))
        self._inference.observe(max(0.0, now - scheduled))
        if first is not None:
            self._prefill.observe(max(0.0, first - scheduled))
            self._decode.observe(max(0.0, now - first))


def _pool_family(kind, short: str, help: str) -> Metric:
    return kind(name(short), help, labels=POOL_LABELS)


def pool_families(engine, model_name: str) -> Iterable[Metric]:
    """Every pool's gauges and counters and the engine's counters, as they are now (run
    on the engine's loop)."""
    g, c = GaugeMetricFamily, CounterMetricFamily
    running = _pool_family(g, "num_requests_running", "requests in the pool's running batch")
    waiting = _pool_family(g, "num_requests_waiting", "requests queued in the pool")
    swapped = _pool_family(g, "num_requests_swapped", "requests swapped out to CPU memory")
    usage = _pool_family(g, "kv_cache_usage_perc", "fraction of the pool's KV blocks in use")
    blocks = _pool_family(g, "kv_cache_num_blocks", "KV blocks of the pool")
    healthy = _pool_family(g, "worker_healthy", "1 while the worker answers its checks")
    queries = _pool_family(
        c, "prefix_cache_queries", "tokens of requests that looked up the prefix cache"
    )
    hits = _pool_family(c, "prefix_cache_hits", "prompt tokens found in the prefix cache")
    preemptions = _pool_family(c, "num_preemptions", "requests preempted for lack of KV blocks")
    prompt_computed = _pool_family(
        c, "prompt_tokens_computed", "prompt (and recomputed) tokens the pool computed"
    )
    transfers = _pool_family(c, "kv_transfers", "KV transfers received by the pool")
    blocks_received = _pool_family(c, "kv_blocks_received", "KV blocks received by the pool")
    drafts = _pool_family(c, "spec_decode_num_drafts", "request-steps that verified proposals")
    draft_tokens = _pool_family(c, "spec_decode_num_draft_tokens", "proposed tokens")
    accepted = _pool_family(c, "spec_decode_num_accepted_tokens", "accepted proposed tokens")
    ext_queries = _pool_family(
        c, "external_prefix_cache_queries", "prompt tokens that looked up the KV offload tier"
    )
    ext_hits = _pool_family(
        c, "external_prefix_cache_hits", "prompt tokens loaded from the KV offload tier"
    )
    saved = _pool_family(c, "kv_offload_saved_blocks", "KV blocks saved to the offload tier")
    loaded = _pool_family(c, "kv_offload_loaded_blocks", "KV blocks loaded from the offload tier")
    held = _pool_family(g, "kv_offload_cached_blocks", "offload tier blocks holding a KV block")
    disk_held = _pool_family(g, "kv_offload_disk_blocks", "KV blocks in the disk tier")
    disk_io = c(
        name("kv_offload_disk_blocks_moved"),
        "KV blocks written to / read from the disk tier",
        labels=(*POOL_LABELS, "direction"),
    )
    disk_failed = _pool_family(
        c, "kv_offload_disk_read_failures", "disk tier reads not served (bad or missing files)"
    )
    tier_labels = (*POOL_LABELS, "medium")
    tier_bytes = g(name("kv_offload_bytes"), "KV bytes held per offload tier", labels=tier_labels)
    load_s = c(
        name("kv_offload_load_seconds"),
        "time spent loading KV back per tier (CPU: into the pool; Disk: reading files)",
        labels=tier_labels,
    )
    for pool in engine.pools:
        labels = [model_name, pool.info.worker_id, pool.info.role]
        s, kv = pool.scheduler, pool.blocks
        running.add_metric(labels, len(s.running))
        waiting.add_metric(labels, len(s.waiting))
        swapped.add_metric(labels, len(s.swapped))
        num_blocks = kv.num_blocks
        usage.add_metric(
            labels, (num_blocks - kv.num_free_blocks) / num_blocks if num_blocks else 0.0
        )
        blocks.add_metric(labels, num_blocks)
        healthy.add_metric(labels, float(pool.healthy))
        queries.add_metric(labels, s.num_prefix_query_tokens)
        hits.add_metric(labels, s.num_prefix_hit_tokens)
        preemptions.add_metric(labels, s.num_preemptions)
        prompt_computed.add_metric(labels, s.num_prompt_tokens_computed)
        transfers.add_metric(labels, pool.counters.kv_transfers)
        blocks_received.add_metric(labels, pool.counters.kv_blocks_received)
        drafts.add_metric(labels, s.spec_decode.num_steps)
        draft_tokens.add_metric(labels, s.spec_decode.num_draft_tokens)
        accepted.add_metric(labels, s.spec_decode.num_accepted_tokens)
        if s.offload is not None:
            tier = s.offload
            ext_queries.add_metric(labels, tier.num_query_tokens)
            ext_hits.add_metric(labels, tier.num_hit_tokens)
            saved.add_metric(labels, tier.num_saved_blocks)
            loaded.add_metric(labels, tier.num_loaded_blocks)
            held.add_metric(labels, tier.num_cached_blocks)
            disk_held.add_metric(labels, tier.num_disk_blocks)
            disk_failed.add_metric(labels, tier.num_disk_failed_blocks)
            for way, count in (
                ("write", tier.num_disk_saved_blocks),
                ("read", tier.num_disk_loaded_blocks),
            ):
                disk_io.add_metric([*labels, way], count)
            block_bytes = pool.info.block_bytes
            tier_bytes.add_metric([*labels, "CPU"], tier.num_cached_blocks * block_bytes)
            tier_bytes.add_metric([*labels, "Disk"], tier.num_disk_blocks * block_bytes)
            load_s.add_metric([*labels, "CPU"], tier.load_seconds)
            load_s.add_metric([*labels, "Disk"], tier.disk_read_seconds)
    yield from (running, waiting, swapped, usage, blocks, healthy, queries, hits, preemptions)
    yield from (prompt_computed, transfers, blocks_received, drafts, draft_tokens, accepted)
    yield from (ext_queries, ext_hits, saved, loaded, held, disk_held, disk_io, disk_failed)
    yield from (tier_bytes, load_s)
    yield from engine_families(engine, model_name)


def engine_families(engine, model_name: str) -> Iterable[Metric]:
    """The engine's counters, and vLLM's `lora_requests_info`."""
    for short, help, value in (
        ("worker_failures", "workers declared failed", engine.num_worker_failures),
        ("restarted_requests", "requests restarted after a failure",
         engine.num_restarted_requests),
        ("queue_rejections", "requests refused: the waiting queue was full",
         engine.num_rejected_requests),
    ):  # fmt: skip
        family = CounterMetricFamily(name(short), help, labels=["model_name"])
        family.add_metric([model_name], value)
        yield family
    yield lora_info(engine, model_name)


def lora_info(engine, model_name: str) -> Metric:
    """vLLM's `lora_requests_info`: one sample whose labels list the adapters of running and
    waiting requests, its value the time of the scrape."""
    running: set[str] = set()
    waiting: set[str] = set()
    max_lora = 0
    for pool in engine.pools:
        s = pool.scheduler
        max_lora = max(max_lora, s.max_loras)
        running.update(r.lora_name for r in s.running if r.lora_name)
        waiting.update(r.lora_name for q in (s.waiting, s.swapped) for r in q if r.lora_name)
    family = GaugeMetricFamily(
        name("lora_requests_info"),
        "LoRA adapters of running and waiting requests (value: scrape time)",
        labels=["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
    )
    family.add_metric(
        [model_name, str(max_lora), ",".join(sorted(running)), ",".join(sorted(waiting))],
        time.time(),
    )
    return family


def kv_event_families(hub: KvEventHub, model_name: str) -> Iterable[Metric]:
    """The KV events published so far, per pool and medium, and their subscribers."""
    labels = [*POOL_LABELS, "medium"]
    g, c = GaugeMetricFamily, CounterMetricFamily
    events = c(name("kv_events"), "KV events published, by kind", labels=[*labels, "event"])
    stored = c(name("kv_blocks_stored"), "blocks the KV events reported cached", labels=labels)
    removed = c(name("kv_blocks_removed"), "blocks the KV events reported dropped", labels=labels)
    held = g(name("kv_blocks_held"), "cached blocks, as the KV events tell", labels=labels)
    for (worker_id, role), tally in hub.tallies.items():
        pool = [model_name, worker_id, role]
        for (medium, kind), count in tally.events.items():
            events.add_metric([*pool, medium, kind], count)
        for medium in tally.stored.keys() | tally.removed.keys() | tally.held.keys():
            stored.add_metric([*pool, medium], tally.stored[medium])
            removed.add_metric([*pool, medium], tally.removed[medium])
            held.add_metric([*pool, medium], tally.held[medium])
    subscribers = g(name("kv_event_subscribers"), "open KvEvents streams", labels=["model_name"])
    subscribers.add_metric([model_name], hub.num_subscribers)
    dropped = c(
        name("kv_event_batches_dropped"),
        "KV event batches dropped for a subscriber that fell behind (it subscribes again)",
        labels=["model_name"],
    )
    dropped.add_metric([model_name], hub.num_dropped)
    yield from (events, stored, removed, held, subscribers, dropped)
