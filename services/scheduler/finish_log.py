"""The `request_finished` log line of a request that ended: why, its usage, its timings and
its speculative decoding (one line per sample; a beam search logs its own in
beam_group.py). Pure Python."""

from __future__ import annotations

from common.log import bind_request, get_logger
from services.scheduler.request import Request

log = get_logger(__name__)


def log_finished(request: Request, error: tuple[str, str] | None, now: float) -> None:
    n_out = len(request.output_token_ids)
    first = request.first_token_time
    with bind_request(request.request_id, request.trace_id):
        log.info(
            "request_finished",
            finish_reason=request.finish_reason.value,
            prompt_tokens=len(request.prompt_token_ids),
            output_tokens=n_out,
            cached_tokens=max(0, request.num_cached_tokens),
            preemptions=request.num_preemptions,
            ttft_ms=round((first - request.arrival_time) * 1e3, 2) if first else None,
            mean_itl_ms=round((now - first) * 1e3 / (n_out - 1), 2)
            if first and n_out > 1
            else None,
            error=error[1] if error else None,
            **_spec_fields(request),
        )


def _spec_fields(request: Request) -> dict:
    """A request's speculative decoding (nothing without it)."""
    if not request.num_draft_tokens:
        return {}
    return {
        "draft_tokens": request.num_draft_tokens,
        "accepted_tokens": request.num_accepted_tokens,
        "acceptance_rate": round(request.num_accepted_tokens / request.num_draft_tokens, 3),
    }
