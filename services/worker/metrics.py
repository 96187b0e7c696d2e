"""The worker's Prometheus metrics: KV moved (bytes, seconds, failures, cancellations, per
direction) and model step time, labelled `model_name`, `worker_id`, `role`. One
observation per transfer or per step, none per token.

Directions: `send` (SendKv, UCX), `receive` (a step plan's KV load over UCX), `pull` (a load
copying from a same-host worker's shared pool).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import Counter, Gauge, Histogram

from common.metrics import SHORT_BUCKETS, name

LABELS = ("model_name", "worker_id", "role")
DIRECTIONS = ("send", "receive", "pull")

KV_BYTES = Counter(name("kv_transfer_bytes"), "KV cache bytes moved", [*LABELS, "direction"])
KV_SECONDS = Histogram(
    name("kv_transfer_seconds"),
    "time of one KV transfer (or one part of a streamed one)",
    [*LABELS, "direction"],
    buckets=SHORT_BUCKETS,
)
KV_FAILURES = Counter(
    name("kv_transfer_failures"), "KV transfers that failed", [*LABELS, "direction"]
)
KV_CANCELLATIONS = Counter(
    name("kv_transfer_cancellations"),
    "KV transfers the scheduler gave up because their request ended (not failures)",
    [*LABELS, "direction"],
)
KV_ABANDONED_BYTES = Gauge(
    name("kv_transfer_abandoned_bytes"),
    "bytes of UCX sends/receives given up on that UCX still holds (back to 0 once UCX "
    "completes or cancels them; growing means buffers stranded behind a dead link)",
    LABELS,
)
STEP_SECONDS = Histogram(
    name("worker_step_execute_seconds"),
    "time the worker spent executing one step (forward pass and sampling)",
    LABELS,
    buckets=SHORT_BUCKETS,
)


class WorkerMetrics:
    """One worker's metrics (labels resolved once)."""

    def __init__(
        self,
        model_name: str,
        worker_id: str,
        role: str,
        abandoned_bytes: Callable[[], float] | None = None,
    ) -> None:
        labels = (model_name, worker_id, role)
        if abandoned_bytes is not None:
            KV_ABANDONED_BYTES.labels(*labels).set_function(abandoned_bytes)
        self._bytes = {d: KV_BYTES.labels(*labels, d) for d in DIRECTIONS}
        self._seconds = {d: KV_SECONDS.labels(*labels, d) for d in DIRECTIONS}
        self._failures = {d: KV_FAILURES.labels(*labels, d) for d in DIRECTIONS}
        self._cancellations = {d: KV_CANCELLATIONS.labels(*labels, d) for d in DIRECTIONS}
        self._step = STEP_SECONDS.labels(*labels)

    def transfer(self, direction: str, num_bytes: int, seconds: float) -> None:
        self._bytes[direction].inc(num_bytes)
        self._seconds[direction].observe(seconds)

    def transfer_failed(self, direction: str) -> None:
        self._failures[direction].inc()

    def transfer_cancelled(self, direction: str) -> None:
        self._cancellations[direction].inc()

    def step(self, seconds: float) -> None:
        self._step.observe(seconds)
