"""The HTTP front's span per request (OpenTelemetry HTTP server conventions: `POST
/v1/completions`, `http.request.method`, `http.route`, `http.response.status_code`): a
child of the client's W3C `traceparent` header, or a new root. It is the current span while
the route runs (and while a streamed body is sent), so the Generate calls to the gateway
carry it in their metadata. An ASGI middleware, installed only when tracing is on
(`create_app`); `/health` probes are not traced.
"""

from __future__ import annotations

from opentelemetry.trace import StatusCode, use_span

from common.tracing import SpanKind, context_from_metadata, start_span

_HEADERS = (b"traceparent", b"tracestate")
# Paths that are their own route (anything else is named by its method alone, as the
# conventions ask when the route is not known: ids in paths would make names unbounded).
ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models"})
UNTRACED = frozenset({"/health"})


class HttpTracing:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in UNTRACED:
            await self.app(scope, receive, send)
            return
        headers = [
            (key.decode("latin-1"), value.decode("latin-1"))
            for key, value in scope.get("headers", ())
            if key in _HEADERS
        ]
        method, path = scope["method"], scope["path"]
        attributes = {"http.request.method": method, "url.path": path}
        if path in ROUTES:
            attributes["http.route"] = path
        span = start_span(
            f"{method} {path}" if path in ROUTES else method,
            context_from_metadata(headers),
            SpanKind.SERVER,
            attributes,
        )

        async def send_traced(message) -> None:
            if message["type"] == "http.response.start":
                status = message["status"]
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(StatusCode.ERROR)
            await send(message)

        with use_span(span, end_on_exit=True):
            await self.app(scope, receive, send_traced)
