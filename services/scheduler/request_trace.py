"""The scheduler's span of one submitted request (`llm_request`, as vLLM names it), a child
of the gateway's span (the submit's `traceparent` field): the request's stage changes
(`handle.py`: prefill when queued again, handoff, transfer, decode, released, done) and
`scheduled` (a step takes it into a worker's batch) are timestamped events on it (its start
is the arrival), each KV transfer is a child span (`kv_transfer`, current while its SendKv
call and its loads run, so they carry it to the workers: in the call's metadata, in the
load's `traceparent`), and the workers continue the trace from the `traceparent` sent once
in each sample's NewRequest. The span ends when the request's
last sample does, with its usage.

With tracing off no RequestTrace exists (`start` returns None) and the callers' checks are
one `is None` each. No grpc here.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

from opentelemetry.trace import use_span

from common.tracing import (
    SpanKind,
    carrier_of,
    child_context,
    context_from_fields,
    enabled,
    end_span,
    span_trace_id,
    start_span,
)
from services.scheduler.request import Request


class RequestTrace:
    """One client request's span, shared by its samples."""

    def __init__(self, span) -> None:
        self.span = span
        self._unfinished = 1
        self._output_tokens = 0
        self._reasons: list[str] = []
        # (traceparent, tracestate) naming this span: the workers' parent.
        self.carrier = carrier_of(span)
        self.trace_id = span_trace_id(span)  # for the log lines of its samples

    @classmethod
    def start(cls, submit, model: str = "") -> RequestTrace | None:
        """The span of a `SubmitRequest`, continuing the gateway's trace; None when
        tracing is off."""
        if not enabled():
            return None
        attributes = {
            "gen_ai.response.id": submit.request_id,
            "gen_ai.request.max_tokens": submit.max_tokens,
            "gen_ai.usage.input_tokens": len(submit.prompt_token_ids),
        }
        if model:
            attributes["gen_ai.request.model"] = model
        if submit.n > 1:
            attributes["gen_ai.request.choice.count"] = submit.n
        parent = context_from_fields(submit.traceparent, submit.tracestate)
        span = start_span("llm_request", parent, SpanKind.SERVER, attributes)
        return cls(span)

    def adopt(self, samples: list[Request]) -> None:
        """The span ends when these samples have; their worker spans are its children.
        (A beam search's beams are not traced on the workers: a new beam every step would
        make a span per token.)"""
        self._unfinished = len(samples)
        for request in samples:
            request.trace_context = self.carrier

    def stage(self, request: Request, stage: str) -> None:
        """A sample moved to `stage` (an event, timestamped now)."""
        name = "released" if stage == "recovering" else stage  # before a restart or the end
        self.span.add_event(name, {"tandem.sample_index": request.index})

    def scheduled(self, request: Request, worker_id: str, step_id: int) -> None:
        """A step (sent to `worker_id`) takes the sample into that worker's batch."""
        self.span.add_event(
            "scheduled",
            {
                "tandem.sample_index": request.index,
                "tandem.worker.id": worker_id,
                "tandem.step_id": step_id,
                "tandem.num_computed_tokens": request.num_computed_tokens,
            },
        )

    def transfer_span(
        self, request: Request, src_worker: str, dst_worker: str
    ) -> AbstractContextManager:
        """The current span while a KV transfer runs (its RPCs carry it to the workers);
        an error or a cancel marks it failed."""
        span = start_span(
            "kv_transfer",
            child_context(self.span),
            SpanKind.CLIENT,
            {
                "tandem.sample_index": request.index,
                "tandem.kv.source_worker": src_worker,
                "tandem.kv.destination_worker": dst_worker,
            },
        )
        return use_span(span, end_on_exit=True)

    def refused(self, code: str, message: str) -> None:
        end_span(self.span, error=f"{code}: {message}")

    def sample_finished(self, request: Request, error: tuple[str, str] | None) -> None:
        """A sample ended; the last one ends the span with the usage."""
        self._output_tokens += len(request.output_token_ids)
        if request.finish_reason is not None:
            self._reasons.append(request.finish_reason.value)
        self._unfinished -= 1
        if self._unfinished:
            if error is not None:
                self.span.add_event("sample_failed", {"tandem.error": ": ".join(error)})
            return
        end_span(
            self.span,
            {
                "gen_ai.usage.output_tokens": self._output_tokens,
                "tandem.usage.cached_tokens": max(0, request.num_cached_tokens),
                "gen_ai.response.finish_reasons": self._reasons,
                "tandem.num_preemptions": request.num_preemptions,
            },
            None if error is None else ": ".join(error),
        )


def transfer_span(
    trace: RequestTrace | None, request: Request, src_worker: str, dst_worker: str
) -> AbstractContextManager:
    """`trace.transfer_span`, or nothing when the request is not traced."""
    if trace is None:
        return nullcontext()
    return trace.transfer_span(request, src_worker, dst_worker)


class Traced(Protocol):
    """What `note_scheduled` reads of a request's handle (`handle.RequestHandle`)."""

    trace: RequestTrace | None


def note_scheduled(plan, handles: Mapping[str, Traced], worker_id: str, step_id: int):
    """`scheduled` events for the traced requests a plan brings to its worker (once per
    request and worker: `is_new`); the engine calls it only while tracing is on."""
    for item in plan.scheduled:
        if item.is_new:
            handle = handles.get(item.request.request_id)  # a beam's is not there
            if handle is not None and handle.trace is not None:
                handle.trace.scheduled(item.request, worker_id, step_id)
