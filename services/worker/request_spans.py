"""A worker's span per traced request (`prefill` on a prefill worker, `decode` on a decode
worker, `prefill_decode` on a `both` worker): a child of the scheduler's span named by the
`traceparent` its NewRequest carries, from the step plan that brings the request to the
plan that drops it (or the Step stream's end). One span per request and worker, never one
per step or token: cached requests' deltas are not looked at.

With tracing off `plan` returns at once. No grpc here.
"""

from __future__ import annotations

from common.step_plan import StepPlan
from common.tracing import SpanKind, context_from_fields, enabled, end_span, start_span

SPAN_NAMES = {"prefill": "prefill", "decode": "decode", "both": "prefill_decode"}


class RequestSpans:
    def __init__(self, worker_id: str, role: str) -> None:
        self.worker_id = worker_id
        self.name = SPAN_NAMES[role]
        self.role = role
        self._open: dict[str, object] = {}

    @property
    def num_open(self) -> int:
        return len(self._open)

    def plan(self, plan: StepPlan) -> None:
        """Close the spans of the requests the plan drops, open those of its new ones."""
        if not enabled():
            return
        if self._open:
            for request_id in plan.finished_ids:
                end_span(self._open.pop(request_id, None))
        for new in plan.new:
            if not new.traceparent:
                continue
            end_span(self._open.pop(new.request_id, None))  # came back (preempted)
            self._open[new.request_id] = start_span(
                self.name,
                context_from_fields(new.traceparent, new.tracestate),
                SpanKind.SERVER,
                {
                    "tandem.request_id": new.request_id,
                    "tandem.worker.id": self.worker_id,
                    "tandem.worker.role": self.role,
                    "tandem.num_tokens": len(new.token_ids),
                    "tandem.num_prompt_tokens": new.num_prompt_tokens,
                    # KV already in place when it arrived (a cached prefix, a transfer).
                    "tandem.num_computed_tokens": new.num_computed_tokens,
                },
            )

    def close_all(self, why: str | None = None) -> None:
        """End every open span (the scheduler went away: `why`)."""
        spans, self._open = list(self._open.values()), {}
        for span in spans:
            end_span(span, error=why)
