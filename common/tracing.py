"""OpenTelemetry tracing for every process: one TracerProvider per process, exporting over
OTLP/gRPC (BatchSpanProcessor) when the standard `OTEL_EXPORTER_OTLP_ENDPOINT` (or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set, and nothing at all when it is not: no
provider, no exporter thread, and every helper below returns at once (`_tracer is None`).

The other standard variables keep their meaning (the SDK and the exporter read them):
`OTEL_SERVICE_NAME` replaces the process's own name (tandem-gateway, tandem-scheduler,
tandem-worker-<role>, tandem-http), `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER` /
`_ARG`, `OTEL_BSP_*`, `OTEL_EXPORTER_OTLP_*` (headers, certificates, insecure, timeout);
`OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` turn tracing off.

Trace context is W3C `traceparent` / `tracestate`: in gRPC metadata on unary calls and on a
stream's opening, and in per-request fields where one stream carries many requests (the
gateway's scheduler session, the workers' step plans). A missing or malformed
`traceparent` starts a new root trace; it is never an error.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

from opentelemetry.context import Context
from opentelemetry.trace import (
    Span,
    SpanKind,
    StatusCode,
    Tracer,
    get_current_span,
    set_span_in_context,
    use_span,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
_KEYS = (TRACEPARENT, TRACESTATE)

_propagator = TraceContextTextMapPropagator()
_tracer: Tracer | None = None
_provider = None  # the SDK's TracerProvider while tracing is on


@dataclass(frozen=True)
class TracingSettings:
    """What the environment asks for: the OTLP endpoint ("" = tracing off) and the name
    this process reports as `service.name`."""

    endpoint: str
    service_name: str

    @property
    def enabled(self) -> bool:
        return bool(self.endpoint)

    @classmethod
    def from_env(cls, service_name: str, env: Mapping[str, str] | None = None) -> TracingSettings:
        env = os.environ if env is None else env
        if not service_name:
            raise ValueError("a traced process needs a service name")
        endpoint = (
            env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
            or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
        )
        off = (
            env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
            or env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none"
        )
        name = env.get("OTEL_SERVICE_NAME", "").strip() or service_name
        return cls("" if off else endpoint, name)


def setup_tracing(service_name: str, env: Mapping[str, str] | None = None) -> bool:
    """Start this process's tracing if the environment asks for it (True); otherwise
    nothing is created and nothing is imported beyond the API (False)."""
    settings = TracingSettings.from_env(service_name, env)
    if not settings.enabled:
        return False
    # Imported only when on: the SDK and the exporter stay out of untraced processes.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # The sampler comes from OTEL_TRACES_SAMPLER (default: parent-based, always on).
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: settings.service_name}))
    # The exporter reads the endpoint, headers, TLS and timeout from OTEL_EXPORTER_OTLP_*.
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    install(provider)
    return True


def install(provider) -> None:
    """Trace through `provider` (an SDK TracerProvider); tests install one with an
    in-memory exporter. Not the global provider: libraries' own spans stay out."""
    global _provider, _tracer
    _provider = provider
    _tracer = provider.get_tracer("tandem")


def shutdown_tracing() -> None:
    """Export what is still buffered (on shutdown or drain) and stop tracing."""
    global _provider, _tracer
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()  # flushes the batch processor


def enabled() -> bool:
    return _tracer is not None


def start_span(
    name: str,
    parent: Context | None,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Mapping[str, object] | None = None,
) -> Span | None:
    """A started span (the caller ends it), child of `parent` (None: a new root trace);
    None when tracing is off."""
    if _tracer is None:
        return None
    return _tracer.start_span(
        name, context=parent if parent is not None else Context(), kind=kind, attributes=attributes
    )


def child_context(span: Span | None) -> Context | None:
    """The context whose children are `span`'s (None: a new root, or tracing off)."""
    return None if span is None else set_span_in_context(span, Context())


def context_from_metadata(metadata: Iterable[tuple[str, object]] | None) -> Context | None:
    """The caller's trace context from gRPC metadata (or HTTP headers as lower-case
    pairs); None when tracing is off or the caller sent none."""
    if _tracer is None or not metadata:
        return None
    carrier = {}
    for key, value in metadata:
        if key in _KEYS:
            carrier[key] = value.decode("latin-1") if isinstance(value, bytes) else str(value)
    return context_from_fields(carrier.get(TRACEPARENT, ""), carrier.get(TRACESTATE, ""))


def context_from_fields(traceparent: str, tracestate: str = "") -> Context | None:
    """The trace context carried in a message's `traceparent` / `tracestate` fields; None
    when tracing is off or the field is empty. A malformed value gives a context with no
    parent span: a new root."""
    if _tracer is None or not traceparent:
        return None
    carrier = {TRACEPARENT: traceparent}
    if tracestate:
        carrier[TRACESTATE] = tracestate
    return _propagator.extract(carrier, context=Context())


def carrier_of(span: Span | None) -> tuple[str, str]:
    """(traceparent, tracestate) naming `span` as the parent; ("", "") without a span."""
    if span is None:
        return "", ""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=set_span_in_context(span, Context()))
    return carrier.get(TRACEPARENT, ""), carrier.get(TRACESTATE, "")


def current_carrier() -> tuple[str, str]:
    """`carrier_of` the current span; ("", "") when tracing is off or none is current."""
    if _tracer is None:
        return "", ""
    span = get_current_span()
    return carrier_of(span) if span.get_span_context().is_valid else ("", "")


def trace_id_of(traceparent: str) -> str:
    """The trace id in a W3C `traceparent` (32 lower-case hex digits); "" when it is empty,
    malformed or all zeros. Log lines carry it (`common.log.bind_request`)."""
    parts = traceparent.split("-")
    if len(parts) < 4 or len(parts[1]) != 32:
        return ""
    trace_id = parts[1].lower()
    if trace_id == "0" * 32 or trace_id.strip("0123456789abcdef"):
        return ""
    return trace_id


def span_trace_id(span: Span | None) -> str:
    """`span`'s trace id (32 hex digits); "" for no span (tracing off) or an invalid one."""
    if span is None:
        return ""
    context = span.get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else ""


def current_trace_id() -> str:
    """The current span's trace id; "" when tracing is off or no span is current."""
    return span_trace_id(get_current_span()) if _tracer is not None else ""


def outgoing_metadata(span: Span | None = None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying `span` (default: the current span) to the callee; () when
    tracing is off or there is no span."""
    if _tracer is None:
        return ()
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=None if span is None else set_span_in_context(span))
    return tuple(carrier.items())


def rpc_span(
    name: str, context, attributes: Mapping[str, object] | None = None
) -> AbstractContextManager[Span | None]:
    """A server span around a unary RPC, child of the caller's context (`context`: the
    call's ServicerContext, its metadata read only when tracing is on); it yields the span
    (None when off), ends with the block, and an exception (an abort) marks it failed."""
    if _tracer is None:
        return nullcontext()
    parent = context_from_metadata(context.invocation_metadata())
    return use_span(start_span(name, parent, SpanKind.SERVER, attributes), end_on_exit=True)


def end_span(
    span: Span | None, attributes: Mapping[str, object] | None = None, error: str | None = None
) -> None:
    """Set `attributes` (None values skipped), mark an error, end the span (None: off)."""
    if span is None:
        return
    for key, value in (attributes or {}).items():
        if value is not None:
            span.set_attribute(key, value)
    if error is not None:
        span.set_status(StatusCode.ERROR, error)
    span.end()
