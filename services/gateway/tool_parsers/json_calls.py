"""Finding calls in JSON text that is still being written: each call object's name (once
its string closed) and the span of its arguments value (`arguments` or `parameters`), for
calls that are elements of an array (`[{...}, {...}]`) or objects one after another
(`{...}; {...}`). Spans are stable as the text grows (a prefix's spans are the longer
text's, cut), so a stream tells what is new by comparing offsets. `CallTracker` turns the
spans of each step into `ToolCallDelta`s. Pure."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.gateway.tool_parsers.base import ToolCallDelta

ARGUMENT_KEYS = ("arguments", "parameters")

# Where the scan is inside one call object.
_KEY, _COLON, _VALUE, _STRING, _CONTAINER, _SCALAR, _AFTER = range(7)


@dataclass
class CallSpan:
    name: str | None = None
    args_start: int | None = None
    args_end: int | None = None  # None while the value is open


class _Scan:
    def __init__(self, text: str, array: bool) -> None:
        self.text = text
        self.array = array
        self.level = 2 if array else 1  # depth inside a call object
        self.spans: list[CallSpan] = []
        self.call: CallSpan | None = None
        self.state = _KEY
        self.key: str | None = None
        self.value_start = 0

    def open_value(self, pos: int, state: int) -> None:
        self.value_start = pos
        if self.key in ARGUMENT_KEYS and self.call.args_start is None:
            self.call.args_start = pos
        self.state = state

    def close_value(self, pos: int) -> None:
        call = self.call
        if self.key in ARGUMENT_KEYS and call.args_start == self.value_start:
            call.args_end = pos
        elif self.key == "name" and self.state == _STRING:
            try:
                name = json.loads(self.text[self.value_start : pos])
            except ValueError:
                name = None
            call.name = name if isinstance(name, str) else None
        self.state = _AFTER

    def run(self) -> list[CallSpan]:
        text, level = self.text, self.level
        depth, in_string, escaped, string_start = 0, False, False, 0
        for i, ch in enumerate(text):
            at_call = self.call is not None and depth == level
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
                    if at_call and self.state == _KEY:
                        self.key = text[string_start + 1 : i]
                        self.state = _COLON
                    elif at_call and self.state == _STRING:
                        self.close_value(i + 1)
                continue
            if ch == '"':
                in_string, string_start = True, i
                if at_call and self.state == _VALUE:
                    self.open_value(i, _STRING)
                elif depth < level:
                    return self.spans  # a string outside any call: not calls
                continue
            if ch in "{[":
                if depth == 0 and ch != ("[" if self.array else "{"):
                    return self.spans
                if depth == level - 1:
                    if ch != "{":
                        return self.spans
                    self.call = CallSpan()
                    self.spans.append(self.call)
                    self.state, self.key = _KEY, None
                elif at_call and self.state == _VALUE:
                    self.open_value(i, _CONTAINER)
                depth += 1
                continue
            if ch in "}]":
                if at_call and self.state == _SCALAR:
                    self.close_value(i)
                depth -= 1
                if self.call is not None and depth == level and self.state == _CONTAINER:
                    self.close_value(i + 1)
                elif depth == level - 1:
                    self.call = None
                if depth < 0 or (self.array and depth == 0):
                    return self.spans
                continue
            if depth == 0:
                if not (ch in ";," or ch.isspace()):
                    return self.spans
                continue
            if not at_call:
                continue
            if ch == ":":
                if self.state == _COLON:
                    self.state = _VALUE
            elif ch == ",":
                if self.state == _SCALAR:
                    self.close_value(i)
                self.state, self.key = _KEY, None
            elif ch.isspace():
                if self.state == _SCALAR:
                    self.close_value(i)
            elif self.state == _VALUE:
                self.open_value(i, _SCALAR)
        return self.spans


def scan_calls(text: str, array: bool) -> list[CallSpan]:
    """The calls of `text` (leading whitespace allowed): the elements of one array when
    `array`, else objects separated by `;`, `,` or whitespace. Scanning stops at anything
    else."""
    stripped = text.lstrip()
    offset = len(text) - len(stripped)
    spans = _Scan(stripped, array).run()
    for span in spans:
        if span.args_start is not None:
            span.args_start += offset
        if span.args_end is not None:
            span.args_end += offset
    return spans


@dataclass
class _Sent:
    id: str
    arguments: int = 0  # characters of the arguments text sent


class CallTracker:
    """What has been streamed of each call; answers the pieces that are new. A call is
    announced (id, name, the arguments so far) once its name is complete; after that
    only argument text is added. Calls come in order: one not yet named holds back the
    ones after it."""

    def __init__(self, new_id: Callable[[], str], first_index: int = 0) -> None:
        self.new_id = new_id
        self.first_index = first_index
        self.sent: list[_Sent] = []

    @property
    def started(self) -> bool:
        return bool(self.sent)

    def update(self, calls: Sequence[tuple[str, CallSpan]]) -> list[ToolCallDelta]:
        """`calls`: per call, the text its span's offsets refer to, and its span."""
        out = []
        for position, (text, span) in enumerate(calls):
            index = self.first_index + position
            arguments = ""
            if span.args_start is not None:
                end = span.args_end if span.args_end is not None else len(text)
                arguments = text[span.args_start : end]
            if position < len(self.sent):
                sent = self.sent[position]
                if len(arguments) > sent.arguments:
                    out.append(ToolCallDelta(index, arguments=arguments[sent.arguments :]))
                    sent.arguments = len(arguments)
                continue
            if span.name is None:
                break
            sent = _Sent(self.new_id(), len(arguments))
            self.sent.append(sent)
            out.append(ToolCallDelta(index, sent.id, span.name, arguments or None))
        return out
