"""The Hermes format (vLLM's `hermes`; Qwen2.5 and Qwen3 write their calls this way, so
vLLM's `qwen3_json` is the same parser): each call is a JSON object
`{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`; text
before the first call is content. Pure."""

from __future__ import annotations

import json
import re

from services.gateway.tool_parsers.base import (
    ContentBeforeMarker,
    Extracted,
    StreamDelta,
    ToolCall,
    dump_arguments,
    openai_call_id,
    tag_overlap,
)
from services.gateway.tool_parsers.json_calls import CallSpan, CallTracker, scan_calls

START, END = "<tool_call>", "</tool_call>"
_CALLS = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def call_bodies(text: str) -> list[str]:
    """The text inside each `<tool_call>` so far (an unclosed last one without any
    partial end tag)."""
    bodies, position = [], 0
    while (start := text.find(START, position)) >= 0:
        body_start = start + len(START)
        end = text.find(END, body_start)
        if end < 0:
            body = text[body_start:]
            cut = tag_overlap(body, END)
            bodies.append(body[: len(body) - cut] if cut else body)
            break
        bodies.append(text[body_start:end])
        position = end + len(END)
    return bodies


class HermesStream:
    def __init__(self, new_id) -> None:
        self._content = ContentBeforeMarker(START)
        self._calls = CallTracker(new_id)

    def feed(self, text: str) -> StreamDelta:
        out = StreamDelta(self._content.take(text))
        calls = []
        for body in call_bodies(text):
            spans = scan_calls(body, array=False)
            calls.append((body, spans[0] if spans else CallSpan()))
        out.calls = self._calls.update(calls)
        return out


class HermesParser:
    keeps_special_tokens = True  # <tool_call> is a special token in some tokenizers

    def extract(self, text: str) -> Extracted:
        if START not in text:
            return Extracted(text)
        try:
            calls = []
            for closed, unclosed in _CALLS.findall(text):
                call = json.loads(closed or unclosed)
                calls.append(ToolCall(call["name"], dump_arguments(call["arguments"])))
        except (ValueError, KeyError, TypeError):
            return Extracted(text)  # not calls after all: all of it is content
        content = text[: text.find(START)]
        return Extracted(content or None, tuple(calls))

    def stream(self) -> HermesStream:
        return HermesStream(self.new_id)

    def new_id(self) -> str:
        return openai_call_id()
