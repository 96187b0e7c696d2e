"""Calls the grammar forced (tool_choice `required` or a named function, as vLLM constrains
them): for `required` the output is a JSON array of `{"name": ..., "parameters": {...}}`
(the schema `required_schema` builds), for a named function it is that function's
arguments object. Parsing, streamed and whole. Pure."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from services.gateway.tool_parsers.base import (
    Extracted,
    StreamDelta,
    ToolCall,
    ToolCallDelta,
    dump_arguments,
)
from services.gateway.tool_parsers.json_calls import CallTracker, scan_calls

EMPTY_OBJECT_SCHEMA = {"type": "object", "properties": {}}


def parameters_or_empty(parameters: dict | None) -> dict:
    """A function's parameters schema; none (or empty) still means a JSON object."""
    return parameters if parameters else EMPTY_OBJECT_SCHEMA


def required_schema(tools: Sequence[tuple[str, dict | None]], parallel: bool) -> dict:
    """The JSON schema of `required` output: an array of one or more calls (at most one
    when `parallel` is false), each naming one of `tools` ((name, parameters) pairs) with
    arguments valid for it. Definitions under `$defs` are hoisted to the array. vLLM's
    schema, except that a call object holds only `name` and `parameters` (vLLM leaves it
    open, so a model may write other keys, without end)."""
    defs: dict = {}
    variants = []
    for name, parameters in tools:
        parameters = dict(parameters_or_empty(parameters))
        for key, value in (parameters.pop("$defs", None) or {}).items():
            if defs.get(key, value) != value:
                raise ValueError(f"$defs {key!r} differs between tools")
            defs[key] = value
        variants.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def extract_required(text: str) -> Extracted:
    """The calls of a whole `required` output (none if it is not a complete array)."""
    try:
        value = json.loads(text or "")
        calls = tuple(
            ToolCall(call["name"], dump_arguments(call.get("parameters"))) for call in value
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        calls = ()
    if not all(isinstance(c.name, str) for c in calls):
        calls = ()
    return Extracted(None, calls)


def extract_named(text: str, name: str) -> Extracted:
    """A named function's call: the whole output is its arguments."""
    if not text.strip():
        return Extracted(None)
    return Extracted(None, (ToolCall(name, text),))


class RequiredStream:
    def __init__(self, new_id: Callable[[], str]) -> None:
        self._calls = CallTracker(new_id)

    def feed(self, text: str) -> StreamDelta:
        return StreamDelta(calls=self._calls.update([(text, s) for s in scan_calls(text, True)]))


class NamedStream:
    """Every piece of text is argument text of the one call."""

    def __init__(self, name: str, new_id: Callable[[], str]) -> None:
        self.name = name
        self.new_id = new_id
        self.sent = 0
        self.id: str | None = None

    def feed(self, text: str) -> StreamDelta:
        piece = text[self.sent :]
        self.sent = len(text)
        if self.id is None:
            self.id = self.new_id()
            return StreamDelta(calls=[ToolCallDelta(0, self.id, self.name, piece)])
        return StreamDelta(calls=[ToolCallDelta(0, arguments=piece)] if piece else [])
