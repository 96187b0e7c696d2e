"""The Responses API's objects: the `response` (OpenAI's fields, as vLLM fills them), its
output items (the assistant `message`, `reasoning` with the reasoning parser's text as a
`reasoning_text` part, `function_call`s with the call id the gateway gave), `usage`
(`input_tokens`, `output_tokens`, their details), the status a finish reason gives
(`length` -> `incomplete` with `incomplete_details.reason` `max_output_tokens`), and the
deletion object. Pure."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from common.pb.tandem.v1 import generate_pb2
from services.openai_api.collect import UsageSum
from services.openai_api.responses_request import ResponsesRequest
from services.openai_api.responses_tools import assistant_turn

STATUS_OF_FINISH = {"stop": "completed", "length": "incomplete", "abort": "cancelled"}


def response_id(request_id: str) -> str:
    """`resp_` and the gateway's request id (its hex digits)."""
    return "resp_" + request_id.replace("-", "")


def message_id() -> str:
    return "msg_" + uuid.uuid4().hex


def reasoning_id() -> str:
    return "rs_" + uuid.uuid4().hex


def function_call_id() -> str:
    return "fc_" + uuid.uuid4().hex


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


def reasoning_item(item_id: str, text: str | None, status: str) -> dict:
    """A reasoning item: the text as one `reasoning_text` part (none while `in_progress`),
    no summary (as vLLM)."""
    content = None if text is None else [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content,
            "encrypted_content": None, "status": status}  # fmt: skip


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str):
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}  # fmt: skip


def output_items(text: str, parsed: generate_pb2.ParsedMessage | None, status: str):
    """A whole answer's output: its text as one message, or with the gateway's parse
    (tools or a reasoning parser) the reasoning item, the message (when there is content)
    and the function calls, in that order (as vLLM); an empty message when nothing at all."""
    if parsed is None:
        return [message_item(message_id(), text, status)]
    items = []
    if parsed.HasField("reasoning_content") and parsed.reasoning_content:
        items.append(reasoning_item(reasoning_id(), parsed.reasoning_content, "completed"))
    if parsed.HasField("content") and parsed.content:
        items.append(message_item(message_id(), parsed.content, status))
    for call in parsed.tool_calls:
        items.append(function_call_item(function_call_id(), call.id, call.name,
                                        call.arguments, "completed"))  # fmt: skip
    if not items:
        items.append(message_item(message_id(), "", status))
    return items


def usage_body(usage: UsageSum) -> dict:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {
            "reasoning_tokens": usage.reasoning_tokens or 0,
            "tool_output_tokens": 0,
        },
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


def stored_turn(parsed: ResponsesRequest, output: list[dict]) -> list[dict]:
    """What this response adds to its conversation: its input and the assistant's answer,
    text and function calls (as chat messages; the instructions stay out, they do not
    carry over)."""
    return [*parsed.input_messages, assistant_turn(output)]
