"""The events of a streamed Messages answer, in Anthropic's order: `message_start` (the
message, empty, with the prompt's `input_tokens`), then per content block
`content_block_start`, `content_block_delta`s (`text_delta`) and `content_block_stop` (a
`ping` after the first block's start, as Anthropic sends one), then `message_delta` (the
`stop_reason`, `stop_sequence` and the final `usage`) and `message_stop`. An answer with no
text is one empty text block, as the unstreamed answer's content. An error after the
stream started is an `error` event in Anthropic's shape. Pure.

Tools / reasoning seam: a `tool_use` block (`input_json_delta`s) or a `thinking` block
would close the text block and open its own, at the next index."""

from __future__ import annotations

from services.openai_api.collect import UsageSum
from services.openai_api.errors import ApiError
from services.openai_api.messages_response import (
    MessageHead,
    error_body,
    message_body,
    text_block,
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
        self.open = False

    def start(self, input_tokens: int) -> list[Event]:
        usage = {"input_tokens": input_tokens, "output_tokens": 0}
        return [event("message_start", message=message_body(self.head, [], (None, None), usage))]

    def _open_text(self) -> list[Event]:
        self.index += 1
        self.open = True
        events = [event("content_block_start", index=self.index, content_block=text_block(""))]
        if self.index == 0:
            events.append(event("ping"))
        return events

    def text(self, text: str) -> list[Event]:
        if not text:
            return []
        events = [] if self.open else self._open_text()
        delta = {"type": "text_delta", "text": text}
        return [*events, event("content_block_delta", index=self.index, delta=delta)]

    def finish(self, stop: tuple[str | None, str | None], usage: UsageSum) -> list[Event]:
        events = [] if self.open else self._open_text()
        delta = {"stop_reason": stop[0], "stop_sequence": stop[1]}
        return [
            *events,
            event("content_block_stop", index=self.index),
            event("message_delta", delta=delta, usage=usage_body(usage)),
            event("message_stop"),
        ]

    @staticmethod
    def error(exc: ApiError) -> Event:
        return "error", error_body(exc)
