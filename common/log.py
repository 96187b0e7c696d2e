"""structlog setup shared by every service: JSON lines off a terminal, colours on one.

Context variables (e.g. `request_id`, bound per RPC with `bind_request`) are merged into
every event, so one request's lines can be followed across gateway, scheduler and workers;
a traced request's lines also carry its `trace_id` (the OpenTelemetry trace's, 32 hex
digits), so a log line leads to the request's trace and a trace to its log lines.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import structlog

_LEVELS = ("debug", "info", "warning", "error")


def setup_logging(service: str, level: str = "info", json: bool | None = None) -> None:
    """Configure structlog for this process; `json=None` picks JSON unless stderr is a tty."""
    if level not in _LEVELS:
        raise ValueError(f"log level must be one of {', '.join(_LEVELS)}, got {level!r}")
    use_json = (not sys.stderr.isatty()) if json is None else json
    renderer = (
        structlog.processors.JSONRenderer()
        if use_json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service)


@contextmanager
def bind_request(request_id: str, trace_id: str = "") -> Iterator[None]:
    """Bind `request_id` (and `trace_id` when the request is traced) into every log event
    emitted inside the block (this task only)."""
    fields = {"request_id": request_id}
    if trace_id:
        fields["trace_id"] = trace_id
    with structlog.contextvars.bound_contextvars(**fields):
        yield


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger(name)
