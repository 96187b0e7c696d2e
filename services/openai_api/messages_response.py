"""Anthropic's Messages API answers: the `message` object (`msg_` id, text content,
`stop_reason` / `stop_sequence`, `usage`), the stop reason a finish gives (a stop string:
`stop_sequence` with the string; a stop token or EOS: `end_turn`; the token limit:
`max_tokens`), and errors in Anthropic's shape
(`{"type": "error", "error": {"type", "message"}}`). Pure."""

from __future__ import annotations

from dataclasses import dataclass

from services.openai_api.collect import UsageSum
from services.openai_api.errors import ApiError

# HTTP status -> Anthropic's error type.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(exc: ApiError) -> dict:
    return {"type": "error", "error": {"type": error_type(exc.status), "message": exc.message}}


def message_id(request_id: str) -> str:
    return "msg_" + request_id.replace("-", "")


@dataclass(frozen=True)
class MessageHead:
    id: str
    model: str


def stop_of(finish_reason: str | None, stop_reason) -> tuple[str | None, str | None]:
    """(`stop_reason`, `stop_sequence`) for a finish and vLLM's stop reason (the stop
    string or stop token id that ended it)."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason != "stop":
        return None, None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def usage_body(usage: UsageSum) -> dict:
    """Anthropic counts cache reads apart: `input_tokens` are the prompt tokens computed."""
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
    }


def text_block(text: str) -> dict:
    return {"type": "text", "text": text}


def message_body(
    head: MessageHead,
    content: list[dict],
    stop: tuple[str | None, str | None],
    usage: dict,
) -> dict:
    return {
        "id": head.id,
        "type": "message",
        "role": "assistant",
        "model": head.model,
        "content": content,
        "stop_reason": stop[0],
        "stop_sequence": stop[1],
        "usage": usage,
    }
