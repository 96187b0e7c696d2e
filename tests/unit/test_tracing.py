"""Trace propagation helpers (`common/tracing.py`) and the per-request spans built on them
(the scheduler's `RequestTrace`, the workers' `RequestSpans`), through the real SDK with an
in-memory exporter: W3C context through gRPC metadata and through the per-request fields,
a new root without one, a malformed `traceparent` ignored, and nothing at all when off."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import format_span_id, format_trace_id

from common import tracing
from common.log import bind_request, get_logger
from common.pb.tandem.internal.v1 import scheduler_pb2, worker_pb2
from common.step_plan import StepPlan
from common.step_plan_pb import plan_from_pb
from services.scheduler.request import Request
from services.scheduler.request_trace import RequestTrace
from services.worker.request_spans import RequestSpans

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
CLIENT_PARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


@pytest.fixture
def spans():
    """Tracing on in this process, every finished span kept in memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    yield exporter
    tracing.shutdown_tracing()


def ids(span) -> tuple[str, str]:
    return format_trace_id(span.context.trace_id), format_span_id(span.context.span_id)


def parent_id(span) -> str | None:
    return None if span.parent is None else format_span_id(span.parent.span_id)


def test_off_creates_nothing_and_every_helper_is_a_no_op():
    assert not tracing.setup_tracing("tandem-test", env={})
    assert not tracing.enabled()
    assert tracing.start_span("x", None) is None
    assert tracing.outgoing_metadata() == ()
    assert tracing.context_from_metadata([("traceparent", CLIENT_PARENT)]) is None
    assert tracing.context_from_fields(CLIENT_PARENT) is None
    assert RequestTrace.start(scheduler_pb2.SubmitRequest(traceparent=CLIENT_PARENT)) is None
    worker_spans = RequestSpans("w", "decode")
    worker_spans.plan(_plan_with(CLIENT_PARENT))
    assert worker_spans.num_open == 0
    with tracing.rpc_span("kv_send", context=None) as span:  # the context is not even read
        assert span is None


def test_settings_follow_the_standard_environment():
    on = tracing.TracingSettings.from_env(
        "tandem-gateway",
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317",
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://traces:4317",
        },
    )
    assert on.enabled and on.endpoint == "http://traces:4317"
    assert on.service_name == "tandem-gateway"
    named = tracing.TracingSettings.from_env(
        "tandem-gateway",
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_SERVICE_NAME": "edge"},
    )
    assert named.service_name == "edge"
    for off in ({"OTEL_SDK_DISABLED": "true"}, {"OTEL_TRACES_EXPORTER": "none"}):
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", **off}
        assert not tracing.TracingSettings.from_env("tandem-gateway", env).enabled
    with pytest.raises(ValueError, match="service name"):
        tracing.TracingSettings.from_env("", {})


def test_setup_with_an_endpoint_names_the_process(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")  # nobody there
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    try:
        assert tracing.setup_tracing("tandem-worker-prefill")
        span = tracing.start_span("x", None)
        assert span.resource.attributes["service.name"] == "tandem-worker-prefill"
    finally:
        tracing.shutdown_tracing()  # nothing was ended: nothing to export
    assert not tracing.enabled()


def test_metadata_carries_the_callers_span(spans):
    caller = tracing.start_span("caller", None)
    caller.set_attribute("k", "v")
    metadata = dict(tracing.outgoing_metadata(caller))
    assert metadata["traceparent"].startswith(f"00-{ids(caller)[0]}-{ids(caller)[1]}-")
    metadata["tracestate"] = "vendor=abc"
    callee = tracing.start_span("callee", tracing.context_from_metadata(metadata.items()))
    callee.end()
    caller.end()
    assert ids(callee)[0] == ids(caller)[0]
    assert parent_id(callee) == ids(caller)[1]
    assert callee.context.trace_state.get("vendor") == "abc"


def test_no_context_or_a_malformed_one_starts_a_new_root(spans):
    for metadata in (
        None,
        [],
        [("authorization", "Bearer x")],
        [("traceparent", "not-a-traceparent")],
        [("traceparent", f"00-{'0' * 32}-{CLIENT_SPAN}-01")],  # the invalid all-zero id
        [("traceparent", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}")],  # flags missing
    ):
        span = tracing.start_span("root", tracing.context_from_metadata(metadata))
        span.end()
        assert span.parent is None, metadata
        assert ids(span)[0] != CLIENT_TRACE
    assert len({ids(s)[0] for s in spans.get_finished_spans()}) == 6


def _plan_with(traceparent: str, finished: tuple[str, ...] = ()) -> StepPlan:
    """A plan as the worker decodes it from the wire, bringing request r1."""
    plan = worker_pb2.StepRequest(finished_request_ids=finished)
    plan.new_requests.append(
        worker_pb2.NewRequest(request_id="r1", token_ids=[1, 2, 3], traceparent=traceparent)
    )
    return plan_from_pb(plan)


def traced_submit(num_samples: int):
    """The gateway's span of a client's traced request, and the scheduler's span of the
    submit that carries it in its field, adopted by the request's samples."""
    gateway = tracing.start_span("text_completion tiny", tracing.context_from_fields(CLIENT_PARENT))
    submit = scheduler_pb2.SubmitRequest(request_id="r", prompt_token_ids=[1, 2, 3])
    submit.n = num_samples
    submit.traceparent, submit.tracestate = tracing.carrier_of(gateway)
    trace = RequestTrace.start(submit, "tiny")
    samples = [Request(f"r{i}", [1, 2, 3], max_tokens=4, index=i) for i in range(num_samples)]
    trace.adopt(samples)
    return gateway, trace, samples


def test_per_request_fields_chain_gateway_scheduler_and_worker(spans):
    # The gateway's span goes to the scheduler in the submit's field ...
    gateway, trace, samples = traced_submit(2)
    trace.stage(samples[0], "decode")
    # ... and the scheduler's to the worker in each sample's NewRequest, once.
    worker_spans = RequestSpans("decode-1", "decode")
    worker_spans.plan(_plan_with(samples[0].trace_context[0]))
    assert worker_spans.num_open == 1
    worker_spans.plan(plan_from_pb(worker_pb2.StepRequest(finished_request_ids=["r1"])))
    assert worker_spans.num_open == 0
    trace.sample_finished(samples[0], None)
    assert not [s for s in spans.get_finished_spans() if s.name == "llm_request"]
    trace.sample_finished(samples[1], ("UNAVAILABLE", "worker lost"))  # the last one ends it
    gateway.end()

    by_name = {s.name: s for s in spans.get_finished_spans()}
    assert set(by_name) == {"text_completion tiny", "llm_request", "decode"}
    assert {ids(s)[0] for s in by_name.values()} == {CLIENT_TRACE}
    assert parent_id(by_name["text_completion tiny"]) == CLIENT_SPAN
    assert parent_id(by_name["llm_request"]) == ids(by_name["text_completion tiny"])[1]
    assert parent_id(by_name["decode"]) == ids(by_name["llm_request"])[1]
    scheduler = by_name["llm_request"]
    assert scheduler.attributes["gen_ai.request.model"] == "tiny"
    assert scheduler.attributes["gen_ai.usage.input_tokens"] == 3
    assert scheduler.attributes["gen_ai.request.choice.count"] == 2
    assert [e.name for e in scheduler.events] == ["decode"]
    assert not scheduler.status.is_ok  # the last sample failed
    assert by_name["decode"].attributes["tandem.worker.id"] == "decode-1"


def test_a_malformed_field_gives_the_scheduler_a_root_and_workers_skip_untraced(spans):
    trace = RequestTrace.start(scheduler_pb2.SubmitRequest(request_id="r", traceparent="00-zz"))
    trace.adopt([Request("r", [1], max_tokens=1)])
    trace.refused("INVALID_ARGUMENT", "bad")
    (span,) = spans.get_finished_spans()
    assert span.parent is None and not span.status.is_ok
    worker_spans = RequestSpans("p", "prefill")
    worker_spans.plan(_plan_with(""))  # a request the scheduler does not trace
    assert worker_spans.num_open == 0
    worker_spans.plan(_plan_with(CLIENT_PARENT))
    worker_spans.close_all("the step stream ended")
    (_, prefill) = spans.get_finished_spans()
    assert prefill.name == "prefill" and parent_id(prefill) == CLIENT_SPAN
    assert not prefill.status.is_ok


def test_log_lines_of_every_sample_name_the_clients_trace(spans, json_log_lines):
    # The gateway's, the scheduler's and every sample's lines carry one trace id.
    gateway, trace, samples = traced_submit(2)
    log = get_logger("t")
    logged = json_log_lines()
    with bind_request("r", tracing.span_trace_id(gateway)):
        log.info("gateway_line")
    with bind_request("r", trace.trace_id):
        log.info("admitted")
    for sample in samples:
        with bind_request(sample.request_id, sample.trace_id):
            log.info("request_finished")
    lines = logged()
    assert [line["trace_id"] for line in lines] == [CLIENT_TRACE] * 4
    assert Request("untraced", [1], max_tokens=1).trace_id == ""
