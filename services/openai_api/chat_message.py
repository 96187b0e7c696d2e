"""The assistant message of a chat answer in vLLM's shape: whole (`message`: content,
`reasoning`, `tool_calls` with ids, and vLLM's always-null OpenAI fields) from the
gateway's parse, or as a streamed `delta` (content, reasoning and call pieces: a call's
first piece has its index, id, type and name, later ones argument text). Pure."""

from __future__ import annotations

from common.pb.tandem.v1 import generate_pb2
from services.openai_api.collect import FINISH_REASONS

ROLE = "assistant"


def message_body(text: str, parsed: generate_pb2.ParsedMessage | None) -> dict:
    """A choice's message: its text, or the gateway's parse of it when there is one."""
    content, reasoning, calls = text, None, []
    if parsed is not None:
        content = parsed.content if parsed.HasField("content") else None
        reasoning = parsed.reasoning_content if parsed.HasField("reasoning_content") else None
        calls = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in parsed.tool_calls
        ]
    body = {
        "role": ROLE,
        "content": content,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
    }
    if calls:
        body["tool_calls"] = calls
    body["reasoning"] = reasoning
    return body


def parsed_finish_reason(parsed: generate_pb2.ParsedMessage | None, streamed: str | None):
    """A whole answer's finish reason: the parse's (tool_calls when calls were made, as a
    non-streaming vLLM answer says), else the stream's."""
    if parsed is None or streamed is None:
        return streamed
    return FINISH_REASONS.get(parsed.finish_reason, streamed)


def call_pieces(response: generate_pb2.GenerateResponse) -> list[dict]:
    pieces = []
    for call in response.tool_calls:
        piece: dict = {"index": call.index}
        function: dict = {}
        if call.id:
            piece["id"], piece["type"] = call.id, "function"
            function["name"] = call.name
        if call.HasField("arguments"):
            function["arguments"] = call.arguments
        piece["function"] = function
        pieces.append(piece)
    return pieces


def delta_body(response: generate_pb2.GenerateResponse) -> dict:
    """A message's delta: content, reasoning and call pieces; {"content": ""} for tokens
    that show nothing yet (clients time tokens by chunks); {} for none."""
    delta: dict = {}
    if response.text:
        delta["content"] = response.text
    if response.reasoning_content:
        delta["reasoning"] = response.reasoning_content
    if response.tool_calls:
        delta["tool_calls"] = call_pieces(response)
    if not delta and response.token_ids:
        delta["content"] = ""
    return delta
