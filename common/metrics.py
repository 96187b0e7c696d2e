"""Prometheus metrics shared by every service: the plain-HTTP endpoint that serves the text
format (on the port of `common.config.metrics_port_setting`, `--metrics-port`), vLLM's
histogram buckets, and `LoopCollector` (gauges and counters computed at scrape time on the
service's asyncio loop, so they read the same state, at the same moment, as an RPC would).

Each service defines its own metrics in its `metrics.py` (names `tandem:<vLLM's name>`);
the full list with each one's vLLM equivalent is in docs/architecture.md, "Metrics".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import REGISTRY, disable_created_metrics, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

from common.lifecycle import StartupError

PREFIX = "tandem:"

# No `*_created` series beside each counter and histogram (as vLLM): they double the
# exposition and no dashboard reads them. Every metrics module imports this one first.
disable_created_metrics()

# vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards and SLOs carry over.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# Tandem's own: a KV transfer or a model step, from sub-millisecond to a minute.
SHORT_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip

SCRAPE_TIMEOUT_S = 5.0


def name(short: str) -> str:
    """'num_requests_running' -> 'tandem:num_requests_running'."""
    return PREFIX + short


@dataclass
class MetricsServer:
    """A running metrics endpoint: its bound port, and how to stop it."""

    host: str
    port: int
    _server: object

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def start_metrics_server(
    host: str, port: int, registry: CollectorRegistry = REGISTRY
) -> MetricsServer | None:
    """Serve `registry` in the Prometheus text format on host:port from a daemon thread
    (None when port is 0: metrics off). Raises StartupError when it cannot listen there."""
    if not port:
        return None
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise StartupError(
            f"could not serve metrics on {host}:{port} (--metrics-port): {exc.strerror or exc}"
        ) from None
    return MetricsServer(host, server.server_port, server)


class LoopCollector(Collector):
    """Metric families computed at scrape time by `families()` on `loop` (the service's
    asyncio loop, which owns the state they read); the scrape thread waits for them."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, families: Callable[[], Iterable[Metric]]
    ) -> None:
        self._loop = loop
        self._families = families

    def collect(self) -> Iterable[Metric]:
        result: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                result.set_result(list(self._families()))
            except Exception as exc:  # noqa: BLE001 - the scrape reports it
                result.set_exception(exc)

        try:
            self._loop.call_soon_threadsafe(run)
        except RuntimeError:  # the loop has closed: the service is stopping
            return []
        return result.result(timeout=SCRAPE_TIMEOUT_S)

    def describe(self) -> Iterable[Metric]:
        return []  # names are not checked at registration (they are computed per scrape)


def status_reason(code_name: str) -> str:
    """A gRPC status name as a `reason` label: 'RESOURCE_EXHAUSTED' -> 'resource_exhausted'."""
    return code_name.lower()
