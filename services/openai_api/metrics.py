"""The HTTP front's Prometheus metrics and its `GET /metrics` (on the API's own port, as
vLLM's): requests by route, method and status, and their duration (to the last byte, a
stream included), measured by a plain ASGI middleware: one counter and one histogram
observation per HTTP request.
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Histogram, generate_latest
from starlette.requests import Request
from starlette.responses import Response

from common.metrics import REQUEST_LATENCY_BUCKETS, name

ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/health",
    "/metrics",
)
MODEL_ROUTE = "/v1/models/{model}"

HTTP_REQUESTS = Counter(
    name("http_requests"),
    "HTTP requests by route, method and status",
    ["handler", "method", "status"],
)
HTTP_SECONDS = Histogram(
    name("http_request_duration_seconds"),
    "time from an HTTP request's arrival to its response's last byte",
    ["handler", "method"],
    buckets=REQUEST_LATENCY_BUCKETS,
)


def handler_label(path: str) -> str:
    """The route a path belongs to (a bounded set: unknown paths are 'other')."""
    if path in ROUTES:
        return path
    if path.startswith("/v1/models/") and len(path) > len("/v1/models/"):
        return MODEL_ROUTE
    return "other"


class HttpMetrics:
    """ASGI middleware that counts and times every HTTP request."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), 500

        async def send_and_see(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_see)
        finally:
            handler, method = handler_label(scope["path"]), scope["method"]
            HTTP_REQUESTS.labels(handler, method, str(status)).inc()
            HTTP_SECONDS.labels(handler, method).observe(time.perf_counter() - started)


async def metrics_endpoint(request: Request) -> Response:
    """Every metric of this process in the Prometheus text format."""
    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)
