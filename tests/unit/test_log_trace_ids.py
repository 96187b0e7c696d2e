"""Log lines carry the trace id of a traced request (`common.log.bind_request`); untraced
requests' lines carry none. The JSON lines are the real structlog output of
`setup_logging`. (One id across gateway, scheduler and samples: tests/unit/test_tracing.py.)"""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import format_trace_id, use_span

from common import tracing
from common.log import bind_request, get_logger

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"


@pytest.fixture
def traced():
    tracing.install(TracerProvider())
    yield
    tracing.shutdown_tracing()


@pytest.mark.parametrize(
    ("traceparent", "expected"),
    [
        (CLIENT_PARENT, CLIENT_TRACE),
        (CLIENT_PARENT.upper(), CLIENT_TRACE),
        ("", ""),
        ("00-" + "0" * 32 + "-00f067aa0ba902b7-01", ""),  # all zeros: invalid in W3C
        ("00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01", ""),  # 31 digits
        ("00-4bf92f3577b34da6a3ce929d0e0e47zz-00f067aa0ba902b7-01", ""),  # not hex
        ("garbage", ""),
    ],
)
def test_trace_id_of_a_traceparent(traceparent, expected):
    assert tracing.trace_id_of(traceparent) == expected


def test_bound_request_lines_carry_the_trace_id_and_untraced_ones_none(json_log_lines):
    log = get_logger("t")
    lines = json_log_lines()
    with bind_request("r1", CLIENT_TRACE):
        log.info("traced_line")
    with bind_request("r2"):
        log.info("untraced_line")
    log.info("outside")
    traced_line, untraced_line, outside = lines()
    assert (traced_line["request_id"], traced_line["trace_id"]) == ("r1", CLIENT_TRACE)
    assert untraced_line["request_id"] == "r2" and "trace_id" not in untraced_line
    assert "request_id" not in outside and "trace_id" not in outside


def test_the_current_span_names_the_http_fronts_trace(traced):
    assert tracing.current_trace_id() == ""  # no span is current
    span = tracing.start_span("POST /v1/completions", tracing.context_from_fields(CLIENT_PARENT))
    with use_span(span, end_on_exit=True):
        assert tracing.current_trace_id() == CLIENT_TRACE
        assert tracing.current_trace_id() == format_trace_id(span.get_span_context().trace_id)
    tracing.shutdown_tracing()
    assert tracing.span_trace_id(None) == ""
    assert tracing.current_trace_id() == ""  # tracing off
