"""Anthropic's Messages API answers: the `message` object (`msg_` id, content blocks:
`thinking` with the reasoning parser's text, `text`, `tool_use` with id `toolu_…` and the
arguments as the `input` object; `stop_reason` / `stop_sequence`, `usage`), the stop
reason a finish gives (a tool call: `tool_use`; a stop string: `stop_sequence` with the
string; a stop token or EOS: `end_turn`; the token limit: `max_tokens`), and errors in
Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`). Pure."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from common.pb.tandem.v1 import generate_pb2
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


def stop_of(
    finish_reason: str | None, stop_reason, tool_used: bool = False
) -> tuple[str | None, str | None]:
    """(`stop_reason`, `stop_sequence`) for a finish and vLLM's stop reason (the stop
    string or stop token id that ended it); `tool_used`: the answer made whole calls."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason not in ("stop", "tool_calls"):
        return None, None
    if tool_used or finish_reason == "tool_calls":
        return "tool_use", None
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


def signature() -> str:
    """A thinking block's signature: opaque, as Anthropic's (nothing checks it here)."""
    return uuid.uuid4().hex


def thinking_block(thinking: str, sig: str) -> dict:
    return {"type": "thinking", "thinking": thinking, "signature": sig}


def tool_use_id(call_id: str) -> str:
    """`toolu_` and the gateway's call id (its random part)."""
    return "toolu_" + call_id.removeprefix("chatcmpl-tool-").replace("-", "")


def tool_use_block(call_id: str, name: str, arguments) -> dict:
    return {"type": "tool_use", "id": tool_use_id(call_id), "name": name, "input": arguments}


def input_of(arguments: str) -> dict:
    """A call's JSON arguments as the `input` object (an empty object when none)."""
    value = json.loads(arguments) if arguments else {}
    return value if isinstance(value, dict) else {"value": value}


def content_blocks(text: str, parsed: generate_pb2.ParsedMessage | None) -> list[dict]:
    """A whole answer's blocks: its text, or with the gateway's parse the thinking block,
    the text (when there is some) and the tool_use blocks (as vLLM orders them); one empty
    text block when none."""
    if parsed is None:
        return [text_block(text)]
    blocks = []
    if parsed.HasField("reasoning_content") and parsed.reasoning_content:
        blocks.append(thinking_block(parsed.reasoning_content, signature()))
    if parsed.HasField("content") and parsed.content:
        blocks.append(text_block(parsed.content))
    for call in parsed.tool_calls:
        blocks.append(tool_use_block(call.id, call.name, input_of(call.arguments)))
    return blocks or [text_block("")]


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
