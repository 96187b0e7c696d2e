"""The gateway's Prometheus metrics: what a client sees of each Generate call.

Tokens and finishes (vLLM's prompt/generation token counters and `request_success_total`),
time to first token, inter-token latency and end-to-end latency as the client sees them
(measured where `Timings` are), refused calls by reason, the requests open on each
scheduler, and how the router follows each scheduler's KV events. One observation per
message (ITL) or per request (the rest): nothing per token.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram

from common.metrics import ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS, name
from common.pb.tandem.v1 import generate_pb2
from services.gateway.output import RequestOutput, SampleTimes

PROMPT_TOKENS = Counter(name("prompt_tokens"), "prompt tokens of finished requests", ["model_name"])
GENERATION_TOKENS = Counter(
    name("generation_tokens"), "tokens generated for finished requests", ["model_name"]
)
REQUEST_SUCCESS = Counter(
    name("request_success"),
    "finished samples (n per request) by finish reason",
    ["model_name", "finished_reason"],
)
REJECTED = Counter(
    name("request_rejected"),
    "Generate calls refused before any output, by reason (the gRPC status, lower case)",
    ["reason"],
)
TTFT = Histogram(
    name("time_to_first_token_seconds"),
    "time from the call's arrival to its first token",
    ["model_name"],
    buckets=TTFT_BUCKETS,
)
ITL = Histogram(
    name("inter_token_latency_seconds"),
    "time between consecutive messages carrying tokens of one sample",
    ["model_name"],
    buckets=ITL_BUCKETS,
)
E2E = Histogram(
    name("e2e_request_latency_seconds"),
    "time from the call's arrival to its last message",
    ["model_name"],
    buckets=REQUEST_LATENCY_BUCKETS,
)

SCHEDULER_REQUESTS = Gauge(
    name("scheduler_requests_open"),
    "requests this gateway has open on each scheduler (the load its routing balances)",
    ["scheduler"],
)

ROUTER_KV_SYNCED = Gauge(
    name("router_kv_events_synced"),
    "1 while routing to the scheduler follows its KV events (0: its memory of what it sent)",
    ["scheduler"],
)
ROUTER_KV_BLOCKS = Gauge(
    name("router_kv_blocks"),
    "prompt blocks the scheduler caches, as its KV events say (0 when not followed)",
    ["scheduler"],
)
ROUTER_KV_LOST = Counter(
    name("router_kv_events_lost"),
    "KV event streams lost (then subscribed again), by reason: gap, ended, bad_message or "
    "the gRPC status in lower case",
    ["scheduler", "reason"],
)

FINISH_LABELS = {
    generate_pb2.FINISH_REASON_STOP: "stop",
    generate_pb2.FINISH_REASON_LENGTH: "length",
    generate_pb2.FINISH_REASON_ABORT: "abort",
}


class GatewayMetrics:
    """The gateway's metrics for one model (labels resolved once)."""

    def __init__(self, model_name: str) -> None:
        self._prompt = PROMPT_TOKENS.labels(model_name)
        self._generation = GENERATION_TOKENS.labels(model_name)
        self._success = {
            reason: REQUEST_SUCCESS.labels(model_name, label)
            for reason, label in FINISH_LABELS.items()
        }
        self._ttft = TTFT.labels(model_name)
        self._itl = ITL.labels(model_name)
        self._e2e = E2E.labels(model_name)

    def message(self, times: SampleTimes, previous_last: float | None) -> None:
        """A message of a sample went out; `previous_last` was the time of its previous
        message with tokens (None: this may be its first)."""
        if previous_last is not None and times.last is not None and times.last > previous_last:
            self._itl.observe(times.last - previous_last)

    def finished(self, output: RequestOutput, last: generate_pb2.GenerateResponse) -> None:
        """Every sample of the request finished; `last` is its last message (its `timings`
        are the ones observed: the client and the histograms see the same numbers)."""
        self._prompt.inc(output.num_prompt_tokens)
        self._generation.inc(sum(s.num_tokens for s in output.samples))
        for sample in output.samples:
            counter = self._success.get(sample.finish_reason)
            if counter is not None:
                counter.inc()
        if any(s.times.first is not None for s in output.samples):
            self._ttft.observe(last.timings.ttft_ms / 1e3)
        self._e2e.observe(last.timings.e2e_ms / 1e3)


def rejected(code_name: str) -> None:
    """A Generate call refused with status `code_name` ('INVALID_ARGUMENT', ...)."""
    REJECTED.labels(code_name.lower()).inc()


def watch_scheduler(address: str, open_requests: Callable[[], int]) -> None:
    """Report `open_requests()` as the scheduler's `scheduler_requests_open`."""
    SCHEDULER_REQUESTS.labels(address).set_function(open_requests)


def watch_kv_events(address: str, index_of: Callable[[], object | None]) -> None:
    """Report whether the router follows the scheduler's KV events (`index_of()`: its index
    or None) and how many blocks that index holds."""
    ROUTER_KV_SYNCED.labels(address).set_function(lambda: float(index_of() is not None))
    ROUTER_KV_BLOCKS.labels(address).set_function(lambda: getattr(index_of(), "num_blocks", 0))


def kv_events_lost(address: str, reason: str) -> None:
    ROUTER_KV_LOST.labels(address, reason).inc()
