"""The events of a streamed Messages answer, in Anthropic's order: `message_start` (the
message, empty, with the prompt's `input_tokens`), then per content block
`content_block_start`, its `content_block_delta`s and `content_block_stop` (a `ping` after
the first block's start, as Anthropic sends one), then `message_delta` (the `stop_reason`,
`stop_sequence` and the final `usage`) and `message_stop`. A block opens when the answer
turns to it and closes when it turns to another or ends (as vLLM streams them):
- `thinking` (the gateway's reasoning parser): `thinking_delta`s, then a `signature_delta`
  before its stop;
- `text`: `text_delta`s;
- `tool_use` (a parsed call: `id` `toolu_…`, `name`, `input: {}` at the start):
  `input_json_delta`s whose `partial_json` add up to the arguments.
An answer with no content is one empty text block, as the unstreamed answer's. The stop
reason is `tool_use` once a call was made. An error after the stream started is an `error`
event in Anthropic's shape. Pure."""

from __future__ import annotations

from common.pb.tandem.v1 import generate_pb2
from services.openai_api.collect import UsageSum
from services.openai_api.errors import ApiError
from services.openai_api.messages_response import (
    MessageHead,
    error_body,
    message_body,
    signature,
    text_block,
    thinking_block,
    tool_use_block,
    usage_body,
)

Event = tuple[str, dict]


def event(kind: str, **fields) -> Event:
    return kind, {"type": kind, **fields}


class MessageEvents:
    """Builds the events of one streamed answer, message by message."""

    def __init__(self, head: MessageHead) -> None:
        self.head = head
        self.index = -1  # the open block's; -1 before the first
        self.kind: str | None = None  # the open block's type
        self.call_index = -1  # the gateway's index of the open tool_use block's call
        self.tool_used = False

    def start(self, input_tokens: int) -> list[Event]:
        usage = {"input_tokens": input_tokens, "output_tokens": 0}
        return [event("message_start", message=message_body(self.head, [], (None, None), usage))]

    def _close(self) -> list[Event]:
        if self.kind is None:
            return []
        events = []
        if self.kind == "thinking":
            delta = {"type": "signature_delta", "signature": signature()}
            events.append(event("content_block_delta", index=self.index, delta=delta))
        self.kind = None
        return [*events, event("content_block_stop", index=self.index)]

    def _open(self, block: dict) -> list[Event]:
        events = self._close()
        self.index += 1
        self.kind = block["type"]
        events.append(event("content_block_start", index=self.index, content_block=block))
        if self.index == 0:
            events.append(event("ping"))
        return events

    def _delta(self, kind: str, block: dict, delta: dict) -> list[Event]:
        events = [] if self.kind == kind else self._open(block)
        return [*events, event("content_block_delta", index=self.index, delta=delta)]

    def text(self, text: str) -> list[Event]:
        if not text:
            return []
        return self._delta("text", text_block(""), {"type": "text_delta", "text": text})

    def thinking(self, text: str) -> list[Event]:
        if not text:
            return []
        delta = {"type": "thinking_delta", "thinking": text}
        return self._delta("thinking", thinking_block("", ""), delta)

    def call(self, piece: generate_pb2.ToolCallDelta) -> list[Event]:
        """A piece of a tool call: its first (id and name) opens a tool_use block."""
        events = []
        if piece.id:
            events = self._open(tool_use_block(piece.id, piece.name, {}))
            self.call_index = piece.index
            self.tool_used = True
        elif self.kind != "tool_use" or self.call_index != piece.index:
            return []  # arguments of no open call: nothing to attach them to
        if piece.arguments:
            delta = {"type": "input_json_delta", "partial_json": piece.arguments}
            events.append(event("content_block_delta", index=self.index, delta=delta))
        return events

    def message(self, response: generate_pb2.GenerateResponse) -> list[Event]:
        """The events for one `Generate` message: thinking, text, then call pieces."""
        events = self.thinking(response.reasoning_content) + self.text(response.text)
        for piece in response.tool_calls:
            events += self.call(piece)
        return events

    def finish(self, stop: tuple[str | None, str | None], usage: UsageSum) -> list[Event]:
        events = self._open(text_block("")) if self.index < 0 else []
        delta = {"stop_reason": stop[0], "stop_sequence": stop[1]}
        return [
            *events,
            *self._close(),
            event("message_delta", delta=delta, usage=usage_body(usage)),
            event("message_stop"),
        ]

    @staticmethod
    def error(exc: ApiError) -> Event:
        return "error", error_body(exc)
