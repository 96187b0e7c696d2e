"""What every tool-call parser shares: the parsed call, the streamed delta of a call (the
OpenAI/vLLM streaming shape: a call's first delta carries its index, id, type and name,
later ones argument fragments), the parser protocol, tool call ids, and text helpers. Pure."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class ToolCall:
    """One complete call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = ""


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of call `index`: its first piece has `id` and `name` (type "function"),
    later ones only `arguments` text to append. `arguments` None: none in this piece."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


@dataclass(frozen=True)
class Extracted:
    """A whole output split into text (None when empty) and calls."""

    content: str | None
    calls: tuple[ToolCall, ...] = ()


@dataclass
class StreamDelta:
    """What one step of a stream adds: content text and call pieces."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


class ToolStream(Protocol):
    """A stream of one sample's output: `feed` gets the whole text so far (it only grows)
    and answers what is new since the previous call."""

    def feed(self, text: str) -> StreamDelta: ...


class ToolParser(Protocol):
    """One output format (vLLM's `--tool-call-parser NAME`)."""

    # Leave special tokens in the text while tools are on (their markers may be special).
    keeps_special_tokens: bool

    def extract(self, text: str) -> Extracted: ...

    def stream(self) -> ToolStream: ...

    def new_id(self) -> str: ...


def openai_call_id() -> str:
    """A tool call id as vLLM makes them."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def dump_arguments(value) -> str:
    """Arguments parsed from the output, written back as vLLM's answers write them."""
    return json.dumps(value, ensure_ascii=False)


def tag_overlap(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper start of `tag` (text that
    must be held back: it may become the tag)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def is_complete_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class ContentBeforeMarker:
    """Streams the text before a call marker: everything up to the marker once it shows,
    before that all but a tail that may be the marker's start."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.sent = 0

    def take(self, text: str) -> str:
        at = text.find(self.marker)
        end = len(text) - tag_overlap(text, self.marker) if at < 0 else at
        if end <= self.sent:
            return ""
        piece, self.sent = text[self.sent : end], end
        return piece
