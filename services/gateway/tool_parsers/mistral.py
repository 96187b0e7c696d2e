"""Mistral's calls (vLLM's `mistral`): content, then `[TOOL_CALLS]` and either a JSON array
of `{"name": ..., "arguments": {...}}` (tokenizers before v11) or, per call,
`[TOOL_CALLS]name[ARGS]{...}` / `[TOOL_CALLS]name{...}` (v11 and later). Call ids are 9
letters and digits, as Mistral's templates require. Pure."""

from __future__ import annotations

import json
import random
import string

from services.gateway.tool_parsers.base import (
    ContentBeforeMarker,
    Extracted,
    StreamDelta,
    ToolCall,
    dump_arguments,
)
from services.gateway.tool_parsers.json_calls import CallSpan, CallTracker, scan_calls

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
ID_CHARS = string.ascii_letters + string.digits


def _named_call(segment: str) -> tuple[str, str] | None:
    """(name, the arguments text) of a v11 segment `name[ARGS]{...}` / `name{...}`, or
    None while the name is not complete."""
    if ARGS in segment:
        name, _, rest = segment.partition(ARGS)
    elif "{" in segment:
        name, rest = segment[: segment.index("{")], segment[segment.index("{") :]
    else:
        return None
    return name.strip(), rest


def _object_span(text: str) -> CallSpan:
    """The span of the first JSON object of `text` (open while unclosed)."""
    start = text.find("{")
    if start < 0:
        return CallSpan()
    try:
        _, end = json.JSONDecoder().raw_decode(text, start)
    except ValueError:
        end = None
    return CallSpan(args_start=start, args_end=end)


class MistralStream:
    def __init__(self, new_id) -> None:
        self._content = ContentBeforeMarker(MARKER)
        self._calls = CallTracker(new_id)

    def feed(self, text: str) -> StreamDelta:
        out = StreamDelta(self._content.take(text))
        if MARKER not in text:
            return out
        segments = text.split(MARKER)[1:]
        if segments[0].lstrip().startswith("["):  # one JSON array of calls
            body = segments[0]
            out.calls = self._calls.update([(body, s) for s in scan_calls(body, True)])
            return out
        calls = []
        for segment in segments:
            named = _named_call(segment)
            if named is None:
                calls.append((segment, CallSpan()))
                break
            name, rest = named
            span = _object_span(rest)
            span.name = name
            calls.append((rest, span))
        out.calls = self._calls.update(calls)
        return out


class MistralParser:
    keeps_special_tokens = True  # [TOOL_CALLS] is a control token

    def extract(self, text: str) -> Extracted:
        if MARKER not in text:
            return Extracted(text)
        content, *segments = text.split(MARKER)
        calls = []
        try:
            first = next((s.strip() for s in segments if s.strip()), "")
            if first.startswith("["):
                value, _ = json.JSONDecoder().raw_decode(first)
                for call in value if isinstance(value, list) else [value]:
                    calls.append(ToolCall(call["name"], dump_arguments(call["arguments"])))
            else:
                for segment in segments:
                    named = _named_call(segment)
                    if named is None:
                        continue
                    name, rest = named
                    value, _ = json.JSONDecoder().raw_decode(rest.strip())
                    calls.append(ToolCall(name, dump_arguments(value)))
        except (ValueError, KeyError, TypeError):
            return Extracted(text)
        if not calls:
            return Extracted(text)
        return Extracted(content if content.strip() else None, tuple(calls))

    def stream(self) -> MistralStream:
        return MistralStream(self.new_id)

    def new_id(self) -> str:
        return "".join(random.choices(ID_CHARS, k=9))
