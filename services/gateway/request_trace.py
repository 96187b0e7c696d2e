"""The gateway's span of one Generate call: a child of the caller's trace (W3C
`traceparent` in the call's metadata) or a new root, named and described with
OpenTelemetry's GenAI conventions (`{operation} {model}`, `gen_ai.request.*`,
`gen_ai.usage.*`, `gen_ai.response.*`); tokenizing is a short child span. The scheduler
continues the trace from the submit's `traceparent` field. With tracing off every method
returns at once (the call's metadata is not even read). No grpc imported here.
"""

from __future__ import annotations

import time

from common.pb.tandem.internal.v1 import scheduler_pb2
from common.pb.tandem.v1 import generate_pb2
from common.tracing import (
    SpanKind,
    carrier_of,
    child_context,
    context_from_metadata,
    enabled,
    end_span,
    start_span,
)

FINISH_NAMES = {
    generate_pb2.FINISH_REASON_STOP: "stop",
    generate_pb2.FINISH_REASON_LENGTH: "length",
    generate_pb2.FINISH_REASON_ABORT: "abort",
}


def operation_of(request: generate_pb2.GenerateRequest) -> str:
    """GenAI's operation name: `chat` for chat messages, else `text_completion`."""
    return "chat" if request.WhichOneof("prompt") == "chat" else "text_completion"


class GenerateTrace:
    """One Generate call's span (None inside when tracing is off)."""

    def __init__(self, context, request: generate_pb2.GenerateRequest, model: str) -> None:
        """`context`: the call's ServicerContext (its metadata may carry a traceparent)."""
        self.span = None
        self.output = None  # the call's RequestOutput, once it has one
        if not enabled():
            return
        parent = context_from_metadata(context.invocation_metadata())
        operation = operation_of(request)
        self.span = start_span(
            f"{operation} {model}",
            parent,
            SpanKind.SERVER,
            {
                "gen_ai.operation.name": operation,
                "gen_ai.request.model": model,
            },
        )

    def tokenize_span(self):
        """A span around tokenizing the prompt (end it with `end_span`); None when off."""
        if self.span is None:
            return None
        return start_span("tokenize", child_context(self.span))

    def submitted(self, submit: scheduler_pb2.SubmitRequest) -> None:
        """Describe the request and name this span as the scheduler's parent."""
        if self.span is None:
            return
        sampling = submit.sampling.params
        attributes = {
            "gen_ai.response.id": submit.request_id,
            "gen_ai.request.max_tokens": submit.max_tokens,
            "gen_ai.usage.input_tokens": len(submit.prompt_token_ids),
            "gen_ai.request.temperature": sampling.temperature,
            "gen_ai.request.top_p": sampling.top_p,
            "gen_ai.request.top_k": sampling.top_k,
        }
        if sampling.HasField("seed"):
            attributes["gen_ai.request.seed"] = sampling.seed
        if submit.n > 1:
            attributes["gen_ai.request.choice.count"] = submit.n
        if submit.lora_name:
            attributes["tandem.lora_name"] = submit.lora_name
        self.span.set_attributes(attributes)
        submit.traceparent, submit.tracestate = carrier_of(self.span)

    def end(self, error: str | None = None) -> None:
        """End the span with the output's usage and finish reasons, and the error the
        call ended with, if any."""
        if self.span is None:
            return
        attributes = {}
        output = self.output
        if output is not None:
            usage = output.usage()
            timings = output.timings(time.monotonic())
            reasons = [FINISH_NAMES.get(s.finish_reason, "") for s in output.samples if s.finished]
            attributes = {
                "gen_ai.usage.output_tokens": usage.completion_tokens,
                "gen_ai.usage.input_tokens": usage.prompt_tokens,
                "tandem.usage.cached_tokens": usage.cached_tokens,
                "gen_ai.response.finish_reasons": reasons,
                "gen_ai.latency.time_to_first_token": timings.ttft_ms / 1e3,
                "gen_ai.latency.e2e": timings.e2e_ms / 1e3,
            }
        end_span(self.span, attributes, error)
