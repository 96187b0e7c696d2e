"""The typed events of a streamed response, in OpenAI's order, each with its
`sequence_number` (0, 1, 2, ... over the stream):

`response.created`, `response.in_progress` (the response `in_progress`, no output yet); on
the first text, `response.output_item.added` (the message, `in_progress`) and
`response.content_part.added` (an empty `output_text`); a `response.output_text.delta` per
piece of text; at the end `response.output_text.done`, `response.content_part.done`,
`response.output_item.done` and the terminal event with the whole response:
`response.completed`, or `response.incomplete` when it stopped on `max_output_tokens` (as
OpenAI; vLLM sends `response.completed` with status `incomplete`). An error after the
stream started is an `error` event. Pure.

Tools / reasoning seam: a function call or reasoning item would open its own output item
(`output_index` 1, 2, ...) beside the message here."""

from __future__ import annotations

from services.openai_api.collect import UsageSum
from services.openai_api.errors import ApiError
from services.openai_api.responses_request import ResponsesRequest
from services.openai_api.responses_response import (
    ResponseHead,
    message_id,
    message_item,
    output_text,
    response_body,
)

TERMINAL = {"completed": "response.completed", "incomplete": "response.incomplete"}


def item_status(status: str) -> str:
    return "completed" if status == "completed" else "incomplete"


class ResponseEvents:
    """Builds the events of one streamed response, message by message."""

    def __init__(self, head: ResponseHead, parsed: ResponsesRequest) -> None:
        self.head = head
        self.parsed = parsed
        self.sequence_number = 0
        self.item_id: str | None = None
        self.texts: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event

    def _part(self, **fields) -> dict:
        return {"item_id": self.item_id, "output_index": 0, "content_index": 0, **fields}

    def start(self) -> list[dict]:
        snapshot = response_body(self.head, self.parsed, [], "in_progress", None)
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def _open(self) -> list[dict]:
        self.item_id = message_id()
        return [
            self._event(
                "response.output_item.added",
                output_index=0,
                item=message_item(self.item_id, None, "in_progress"),
            ),
            self._event(
                "response.content_part.added", **self._part(part=output_text("", logprobs=[]))
            ),  # fmt: skip
        ]

    def delta(self, text: str) -> list[dict]:
        """The events for a piece of generated text (none for an empty one)."""
        if not text:
            return []
        events = self._open() if self.item_id is None else []
        self.texts.append(text)
        events.append(self._event("response.output_text.delta",
                                  **self._part(delta=text, logprobs=[])))  # fmt: skip
        return events

    def finish(self, status: str, usage: UsageSum) -> tuple[list[dict], dict]:
        """The closing events and the final response (also what the store keeps)."""
        events = self._open() if self.item_id is None else []
        text = self.text
        item = message_item(self.item_id, text, item_status(status))
        events += [
            self._event("response.output_text.done", **self._part(text=text, logprobs=[])),
            self._event("response.content_part.done", **self._part(part=output_text(text))),
            self._event("response.output_item.done", output_index=0, item=item),
        ]
        final = response_body(self.head, self.parsed, [item], status, usage)
        events.append(self._event(TERMINAL.get(status, "response.failed"), response=final))
        return events, final

    def error(self, exc: ApiError) -> dict:
        return self._event("error", code=exc.code, message=exc.message, param=exc.param)
