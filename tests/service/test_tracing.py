"""OpenTelemetry tracing across a real stack (HTTP front, gateway, scheduler, a prefill and a
decode worker moving KV over UCX), exporting over OTLP/gRPC to a collector run here (the
TraceService of opentelemetry-proto, spans kept in memory): one request with a client's
`traceparent` gives one trace, a span from every hop with the right parents; a call the
gateway refuses leaves one failed span; a stack started without OTEL_EXPORTER_OTLP_ENDPOINT
exports nothing."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from concurrent import futures
from contextlib import contextmanager

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from common.pb.tandem.v1 import generate_pb2_grpc
from tests.stack_client import greedy_request, wait_until_idle

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
REFUSED_TRACE = "5b8efff798038103d269b633813fc60c"
REFUSED_SPAN = "eee19b7ec3c1b174"
REFUSED_PARENT = f"00-{REFUSED_TRACE}-{REFUSED_SPAN}-01"
SAMPLES_TRACE = "6c9a2f1e0d3b4a5968778695a4b3c2d1"
BEAM_TRACE = "7d0b3e2f1c4a5b6978695a4b3c2d1e0f"
OTLP_DEFAULT_PORT = 4317  # where an exporter sends when no endpoint is configured


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every exported span as (service.name, span)."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []
        self._lock = threading.Lock()

    def Export(self, request, context):
        with self._lock:
            for resource_spans in request.resource_spans:
                service = next(
                    a.value.string_value
                    for a in resource_spans.resource.attributes
                    if a.key == "service.name"
                )
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend((service, span) for span in scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def snapshot(self) -> list[tuple[str, object]]:
        with self._lock:
            return list(self.spans)


@contextmanager
def collector(port: int = 0):
    """An OTLP/gRPC trace collector on 127.0.0.1:`port` (0: a free one): (it, its port)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    kept = Collector()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(kept, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    if not bound:
        pytest.fail(f"the test collector cannot listen on 127.0.0.1:{port} (in use?)")
    server.start()
    try:
        yield kept, bound
    finally:
        server.stop(0)


def hex_id(raw: bytes) -> str:
    return raw.hex()


def attribute(span, key: str):
    for a in span.attributes:
        if a.key == key:
            value = a.value
            return getattr(value, value.WhichOneof("value"))
    return None


# (service.name, span name) of every span one request must leave, and its parent's.
EXPECTED_PARENTS = {
    ("tandem-http", "POST /v1/completions"): None,  # the client's span
    ("tandem-gateway", "text_completion"): ("tandem-http", "POST /v1/completions"),
    ("tandem-gateway", "tokenize"): ("tandem-gateway", "text_completion"),
    ("tandem-scheduler", "llm_request"): ("tandem-gateway", "text_completion"),
    ("tandem-worker-prefill", "prefill"): ("tandem-scheduler", "llm_request"),
    ("tandem-scheduler", "kv_transfer"): ("tandem-scheduler", "llm_request"),
    ("tandem-worker-prefill", "kv_send"): ("tandem-scheduler", "kv_transfer"),
    ("tandem-worker-decode", "kv_receive"): ("tandem-scheduler", "kv_transfer"),
    ("tandem-worker-decode", "decode"): ("tandem-scheduler", "llm_request"),
}


def short_name(name: str) -> str:
    """`text_completion <model>` -> `text_completion` (the model is the stack's path)."""
    return name.split(" ")[0] if name.startswith("text_completion ") else name


def wait_for_spans(kept: Collector, done, timeout_s: float = 20.0) -> list[tuple[str, object]]:
    """The collector's spans once `done(spans)` holds (or as they are after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while not done(spans := kept.snapshot()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return spans


def of_trace(spans, trace_id: str) -> dict[tuple[str, str], object]:
    return {
        (service, short_name(span.name)): span
        for service, span in spans
        if hex_id(span.trace_id) == trace_id
    }


def ended(trace_id: str, spans) -> bool:
    """The side requests' spans are in: the refused call's, each scheduler span and the
    two samples' decode spans."""
    names = [span.name for _, span in spans if hex_id(span.trace_id) == trace_id]
    if trace_id == REFUSED_TRACE:
        return bool(names)
    return "llm_request" in names and (trace_id != SAMPLES_TRACE or names.count("decode") == 2)


def test_one_trace_through_every_hop(launch_stack):
    with collector() as (kept, port):
        stack = launch_stack(
            http=True,
            env={
                "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
                "OTEL_BSP_SCHEDULE_DELAY": "50",  # ms: export soon after a span ends
                "TANDEM_KV_TRANSFER_SHARED_MEMORY": "false",  # KV over UCX: SendKv too
            },
        )
        body = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        http = urllib.request.Request(
            f"http://{stack.spec.http_address}/v1/completions",
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json", "traceparent": TRACEPARENT},
        )
        with urllib.request.urlopen(http, timeout=60) as response:
            usage = json.load(response)["usage"]
        wait_until_idle(stack)  # the workers have dropped the request: spans ended
        spans = wait_for_spans(
            kept, lambda s: set(EXPECTED_PARENTS) <= set(of_trace(s, CLIENT_TRACE))
        )

        # A call the gateway refuses (a gRPC client's, straight to it) ends its span failed.
        refused = greedy_request("Once upon a time", 4)
        refused.sampling.temperature = -1.0
        # Two samples, and a beam search, traced: they complete, and each scheduler span
        # ends once.
        samples = greedy_request("Once upon a time", 6)
        samples.n, samples.sampling.temperature, samples.sampling.seed = 2, 1.0, 7
        samples.stopping.ignore_eos = True
        beam = greedy_request("Once upon a time", 4)
        beam.beam_search.beam_width = 2
        with grpc.insecure_channel(stack.spec.gateway_address) as channel:
            stub = generate_pb2_grpc.GenerateServiceStub(channel)
            with pytest.raises(grpc.RpcError) as error:
                list(stub.Generate(refused, metadata=[("traceparent", REFUSED_PARENT)]))
            for request, trace_id in ((samples, SAMPLES_TRACE), (beam, BEAM_TRACE)):
                parent = [("traceparent", f"00-{trace_id}-{CLIENT_SPAN}-01")]
                assert list(stub.Generate(request, metadata=parent))[-1].HasField("usage")
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        wait_until_idle(stack)
        traces = (REFUSED_TRACE, SAMPLES_TRACE, BEAM_TRACE)
        spans = wait_for_spans(kept, lambda s: all(ended(t, s) for t in traces))

    assert {hex_id(span.trace_id) for _, span in spans} == {CLIENT_TRACE, *traces}
    got = of_trace(spans, CLIENT_TRACE)
    assert set(EXPECTED_PARENTS) <= set(got), sorted(got)
    # One of each: one request, one span per hop (none per step or token).
    assert sum(hex_id(sp.trace_id) == CLIENT_TRACE for _, sp in spans) == len(EXPECTED_PARENTS)
    for key, parent in EXPECTED_PARENTS.items():
        expected = CLIENT_SPAN if parent is None else hex_id(got[parent].span_id)
        assert hex_id(got[key].parent_span_id) == expected, (key, parent)
    gateway = got[("tandem-gateway", "text_completion")]
    assert attribute(gateway, "gen_ai.usage.input_tokens") == usage["prompt_tokens"]
    assert attribute(gateway, "gen_ai.usage.output_tokens") == usage["completion_tokens"] == 4
    assert attribute(gateway, "gen_ai.request.max_tokens") == 4
    scheduler = got[("tandem-scheduler", "llm_request")]
    stages = [e.name for e in scheduler.events]
    assert stages == ["scheduled", "handoff", "transfer", "decode", "scheduled", "released", "done"]
    workers = [attribute(e, "tandem.worker.id") for e in scheduler.events if e.name == "scheduled"]
    assert [w.split("-")[0] for w in workers] == ["prefill", "decode"]
    assert attribute(got[("tandem-worker-decode", "kv_receive")], "tandem.kv.mode") == "ucx"
    http_span = got[("tandem-http", "POST /v1/completions")]
    assert attribute(http_span, "http.response.status_code") == 200

    (only,) = of_trace(spans, REFUSED_TRACE).items()  # refused before the scheduler
    (service, name), span = only
    assert (service, name) == ("tandem-gateway", "text_completion")
    assert hex_id(span.parent_span_id) == REFUSED_SPAN
    assert span.status.code == span.status.STATUS_CODE_ERROR
    assert span.status.message.startswith("INVALID_ARGUMENT: sampling.temperature")

    for trace_id in (SAMPLES_TRACE, BEAM_TRACE):
        names = [(service, sp.name) for service, sp in spans if hex_id(sp.trace_id) == trace_id]
        assert names.count(("tandem-scheduler", "llm_request")) == 1, names
        # Per request and hop: a beam search's beams (a new request each step) add none.
        limit = 2 * len(EXPECTED_PARENTS) if trace_id == SAMPLES_TRACE else len(EXPECTED_PARENTS)
        assert len(names) <= limit, names
    samples_trace = [sp.name for _, sp in spans if hex_id(sp.trace_id) == SAMPLES_TRACE]
    assert samples_trace.count("prefill") == samples_trace.count("decode") == 2, samples_trace

    # Log lines name the trace too: every finished sample's line in the scheduler's log,
    # the refusal's in the gateway's.
    finished = [e for e in log_events(stack, "scheduler") if e["event"] == "request_finished"]
    assert sorted(e.get("trace_id") for e in finished) == sorted(
        [CLIENT_TRACE, SAMPLES_TRACE, SAMPLES_TRACE, BEAM_TRACE]
    ), finished
    (invalid,) = [e for e in log_events(stack, "gateway") if e["event"] == "invalid_request"]
    assert invalid["trace_id"] == REFUSED_TRACE and invalid["request_id"]


def log_events(stack, name: str) -> list[dict]:
    """The JSON events of one service's log."""
    text = (stack.run_dir / "logs" / f"{name}.log").read_text()
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_a_stack_without_an_endpoint_exports_nothing(api_stack):
    """api_stack runs with this process's environment: no OTEL endpoint. A collector on the
    OTLP default port would receive whatever an exporter with no endpoint set sends."""
    with collector(OTLP_DEFAULT_PORT) as (kept, _):
        request = greedy_request("Once upon a time", 4)
        with grpc.insecure_channel(api_stack.spec.gateway_address) as channel:
            stub = generate_pb2_grpc.GenerateServiceStub(channel)
            # A client's traceparent is accepted (and goes nowhere).
            messages = list(stub.Generate(request, metadata=[("traceparent", TRACEPARENT)]))
        assert messages[-1].usage.completion_tokens == 4
        wait_until_idle(api_stack)
        # A batch processor exports within its delay (OTEL_BSP_SCHEDULE_DELAY, 5 s by
        # default): wait that long for spans that must not come.
        time.sleep(5.5)
        assert kept.snapshot() == []
