"""Llama 3.x / 4 JSON calls (vLLM's `llama3_json`, `llama4_json`): the output is one or more
JSON objects `{"name": ..., "arguments": {...}}` (or `"parameters"`), separated by `;`,
optionally after `<|python_tag|>`. Anything else is content. Pure."""

from __future__ import annotations

import json

from services.gateway.tool_parsers.base import (
    Extracted,
    StreamDelta,
    ToolCall,
    dump_arguments,
    openai_call_id,
)
from services.gateway.tool_parsers.json_calls import CallTracker, scan_calls

PYTHON_TAG = "<|python_tag|>"


def _calls_text(text: str) -> str | None:
    """The text holding the calls, or None when `text` does not start as calls."""
    stripped = text.lstrip()
    if stripped.startswith(PYTHON_TAG):
        stripped = stripped[len(PYTHON_TAG) :]
    elif PYTHON_TAG.startswith(stripped):
        return ""  # may still become the tag
    if stripped and not stripped.lstrip().startswith("{"):
        return None
    return stripped


class Llama3JsonStream:
    def __init__(self, new_id) -> None:
        self._calls = CallTracker(new_id)
        self._content_sent = 0
        self._is_content: bool | None = None

    def feed(self, text: str) -> StreamDelta:
        if self._is_content is None:
            body = _calls_text(text)
            if body is None:
                self._is_content = True
            elif body.strip():
                self._is_content = False
        if self._is_content:
            piece, self._content_sent = text[self._content_sent :], len(text)
            return StreamDelta(piece)
        body = _calls_text(text) or ""
        return StreamDelta(calls=self._calls.update([(body, s) for s in scan_calls(body, False)]))


class Llama3JsonParser:
    keeps_special_tokens = True  # <|python_tag|> is a special token

    def extract(self, text: str) -> Extracted:
        decoder, calls, position = json.JSONDecoder(), [], 0
        while (start := text.find("{", position)) >= 0:
            try:
                value, end = decoder.raw_decode(text, start)
                name = value["name"]
                arguments = value["arguments"] if "arguments" in value else value["parameters"]
            except (ValueError, KeyError, TypeError):
                return Extracted(text)
            calls.append(ToolCall(name, dump_arguments(arguments)))
            position = end
        return Extracted(None, tuple(calls)) if calls else Extracted(text)

    def stream(self) -> Llama3JsonStream:
        return Llama3JsonStream(self.new_id)

    def new_id(self) -> str:
        return openai_call_id()
