"""The Responses API's objects: the `response` (OpenAI's fields, as vLLM fills them), its
output message item, `usage` (`input_tokens`, `output_tokens`, their details), the status a
finish reason gives (`length` -> `incomplete` with `incomplete_details.reason`
`max_output_tokens`), and the deletion object. Pure."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from services.openai_api.collect import UsageSum
from services.openai_api.responses_request import ResponsesRequest

STATUS_OF_FINISH = {"stop": "completed", "length": "incomplete", "abort": "cancelled"}


def response_id(request_id: str) -> str:
    """`resp_` and the gateway's request id (its hex digits)."""
    return "resp_" + request_id.replace("-", "")


def message_id() -> str:
    return "msg_" + uuid.uuid4().hex


@dataclass(frozen=True)
class ResponseHead:
    """What every snapshot of one response carries."""

    id: str
    created_at: int
    model: str


def status_of(finish_reason: str | None) -> str:
    return STATUS_OF_FINISH.get(finish_reason or "stop", "completed")


def incomplete_details(status: str) -> dict | None:
    return {"reason": "max_output_tokens"} if status == "incomplete" else None


def output_text(text: str, logprobs: list | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def message_item(item_id: str, text: str | None, status: str) -> dict:
    """An assistant message item: one `output_text` part (none while `in_progress`)."""
    content = [] if text is None else [output_text(text)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": content, "phase": None}  # fmt: skip


def usage_body(usage: UsageSum) -> dict:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def response_body(
    head: ResponseHead,
    parsed: ResponsesRequest,
    output: list[dict],
    status: str,
    usage: UsageSum | None,
) -> dict:
    return {
        "id": head.id,
        "object": "response",
        "created_at": head.created_at,
        "status": status,
        "error": None,
        "incomplete_details": incomplete_details(status),
        "model": head.model,
        "output": output,
        "usage": None if usage is None else usage_body(usage),
        **parsed.echo,
    }


def deleted_body(response_id: str) -> dict:
    return {"id": response_id, "object": "response", "deleted": True}


def stored_turn(parsed: ResponsesRequest, text: str) -> list[dict]:
    """What this response adds to its conversation: its input and the assistant's answer
    (as chat messages; the instructions stay out, they do not carry over)."""
    return [*parsed.input_messages, {"role": "assistant", "content": text}]
