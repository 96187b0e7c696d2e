"""What the engine checks before it takes a request: the request's own limits (a field and
its limit named in the error) and room in the waiting queue. Pure Python."""

from __future__ import annotations

from collections.abc import Container, Sequence

from services.scheduler.request import Request


class InvalidRequestError(ValueError):
    """The request breaks a limit; the message names the field and the limit."""


class OverloadedError(RuntimeError):
    """The waiting queue is full; the client should retry later (RESOURCE_EXHAUSTED)."""


def validate_request(
    request: Request, running: Container[str], vocab_size: int, max_model_len: int
) -> None:
    """Raise InvalidRequestError for a request id already `running`, an empty prompt, a
    token outside the vocabulary, or more tokens than the context holds."""
    n = len(request.prompt_token_ids)
    if request.request_id in running:
        raise InvalidRequestError(f"request_id {request.request_id!r} is already running")
    if n == 0:
        raise InvalidRequestError("prompt_token_ids must not be empty")
    bad = [t for t in request.prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"prompt_token_ids must be in [0, {vocab_size}), got {bad[0]}")
    if request.max_tokens < 1:
        raise InvalidRequestError(f"max_tokens must be >= 1, got {request.max_tokens}")
    if n + request.max_tokens > max_model_len:
        raise InvalidRequestError(
            f"prompt ({n} tokens) + max_tokens ({request.max_tokens}) exceeds the context "
            f"length max_model_len={max_model_len}"
        )


def check_queue_room(waiting: tuple[int, int], samples: Sequence[Request], limits) -> None:
    """Raise OverloadedError when `samples` would take the waiting queue (`waiting`:
    requests, tokens) past `limits.max_waiting_requests` or `max_waiting_tokens`."""
    requests, tokens = waiting
    new_tokens = sum(s.num_known_tokens for s in samples)
    if requests + len(samples) > limits.max_waiting_requests:
        raise OverloadedError(
            f"server overloaded: {requests} requests waiting, the queue holds "
            f"max_waiting_requests={limits.max_waiting_requests}; retry later"
        )
    if requests and tokens + new_tokens > limits.max_waiting_tokens:
        raise OverloadedError(
            f"server overloaded: {tokens} prompt tokens waiting + {new_tokens} new exceed "
            f"max_waiting_tokens={limits.max_waiting_tokens}; retry later"
        )
