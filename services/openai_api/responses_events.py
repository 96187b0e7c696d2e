"""The typed events of a streamed response, in OpenAI's order, each with its
`sequence_number` (0, 1, 2, ... over the stream):

`response.created`, `response.in_progress` (the response `in_progress`, no output yet); then
one output item after another (`output_index` 0, 1, ...), each opened when the answer turns
to it and closed when it turns to another or ends, as vLLM streams them:
- a `message`: `response.output_item.added`, `response.content_part.added` (an empty
  `output_text`), `response.output_text.delta`..., `response.output_text.done`,
  `response.content_part.done`, `response.output_item.done`;
- a `reasoning` item (the gateway's reasoning parser): the same with a `reasoning_text`
  part and `response.reasoning_text.delta` / `.done`;
- a `function_call` (a parsed tool call; `call_id` the gateway's call id):
  `response.output_item.added` (empty `arguments`), `response.function_call_arguments.delta`
  ..., `response.function_call_arguments.done`, `response.output_item.done`.
An answer with no output at all is one empty message. Last, the terminal event with the
whole response: `response.completed`, or `response.incomplete` when it stopped on
`max_output_tokens` (as OpenAI; vLLM sends `response.completed` with status `incomplete`).
An error after the stream started is an `error` event. Pure."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.pb.tandem.v1 import generate_pb2
from services.openai_api.collect import UsageSum
from services.openai_api.errors import ApiError
from services.openai_api.responses_request import ResponsesRequest
from services.openai_api.responses_response import (
    ResponseHead,
    function_call_id,
    function_call_item,
    message_id,
    message_item,
    output_text,
    reasoning_id,
    reasoning_item,
    response_body,
)

TERMINAL = {"completed": "response.completed", "incomplete": "response.incomplete"}
TEXT_EVENTS = {"message": "response.output_text", "reasoning": "response.reasoning_text"}


def item_status(status: str) -> str:
    return "completed" if status == "completed" else "incomplete"


@dataclass
class OpenItem:
    kind: str  # "message", "reasoning" or "function_call"
    id: str
    index: int  # output_index
    texts: list[str] = field(default_factory=list)  # text, reasoning or arguments
    call_id: str = ""
    name: str = ""
    call_index: int = -1  # the gateway's index of the call

    @property
    def text(self) -> str:
        return "".join(self.texts)


class ResponseEvents:
    """Builds the events of one streamed response, message by message."""

    def __init__(self, head: ResponseHead, parsed: ResponsesRequest) -> None:
        self.head = head
        self.parsed = parsed
        self.sequence_number = 0
        self.open: OpenItem | None = None
        self.output: list[dict] = []  # the items closed so far

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return event

    def _part(self, **fields) -> dict:
        item = self.open
        return {"item_id": item.id, "output_index": item.index, "content_index": 0, **fields}

    def start(self) -> list[dict]:
        snapshot = response_body(self.head, self.parsed, [], "in_progress", None)
        return [
            self._event("response.created", response=snapshot),
            self._event("response.in_progress", response=snapshot),
        ]

    def _open_text(self, kind: str) -> list[dict]:
        index = len(self.output)
        if kind == "message":
            self.open = OpenItem(kind, message_id(), index)
            item, part = message_item(self.open.id, None, "in_progress"), output_text("", [])
        else:
            self.open = OpenItem(kind, reasoning_id(), index)
            item = reasoning_item(self.open.id, None, "in_progress")
            part = {"type": "reasoning_text", "text": ""}
        return [
            self._event("response.output_item.added", output_index=index, item=item),
            self._event("response.content_part.added", **self._part(part=part)),
        ]

    def _close(self, status: str = "completed") -> list[dict]:
        item = self.open
        if item is None:
            return []
        text = item.text
        if item.kind == "function_call":
            done = function_call_item(item.id, item.call_id, item.name, text, "completed")
            events = [
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item.id,
                    output_index=item.index,
                    name=item.name,
                    arguments=text,
                )
            ]
        elif item.kind == "message":
            done = message_item(item.id, text, item_status(status))
            events = [
                self._event("response.output_text.done", **self._part(text=text, logprobs=[])),
                self._event("response.content_part.done", **self._part(part=output_text(text))),
            ]  # fmt: skip
        else:
            done = reasoning_item(item.id, text, "completed")
            part = {"type": "reasoning_text", "text": text}
            events = [
                self._event("response.reasoning_text.done", **self._part(text=text)),
                self._event("response.content_part.done", **self._part(part=part)),
            ]
        events.append(self._event("response.output_item.done", output_index=item.index,
                                  item=done))  # fmt: skip
        self.open = None
        self.output.append(done)
        return events

    def _text(self, kind: str, text: str) -> list[dict]:
        if not text:
            return []
        events = []
        if self.open is None or self.open.kind != kind:
            events = self._close() + self._open_text(kind)
        self.open.texts.append(text)
        name = TEXT_EVENTS[kind] + ".delta"
        extra = {"logprobs": []} if kind == "message" else {}
        return [*events, self._event(name, **self._part(delta=text, **extra))]

    def delta(self, text: str) -> list[dict]:
        """The events for a piece of generated text (none for an empty one)."""
        return self._text("message", text)

    def reasoning(self, text: str) -> list[dict]:
        return self._text("reasoning", text)

    def call(self, piece: generate_pb2.ToolCallDelta) -> list[dict]:
        """A piece of a tool call: its first (id and name) opens a function_call item."""
        events = []
        item = self.open
        if piece.id:
            events = self._close()
            item = OpenItem(
                "function_call",
                function_call_id(),
                len(self.output),
                call_id=piece.id,
                name=piece.name,
                call_index=piece.index,
            )
            self.open = item
            added = function_call_item(item.id, item.call_id, item.name, "", "in_progress")
            events.append(self._event("response.output_item.added", output_index=item.index,
                                      item=added))  # fmt: skip
        elif item is None or item.kind != "function_call" or item.call_index != piece.index:
            return []  # arguments of no open call: nothing to attach them to
        if piece.arguments:
            item.texts.append(piece.arguments)
            events.append(self._event("response.function_call_arguments.delta",
                                      item_id=item.id, output_index=item.index,
                                      delta=piece.arguments))  # fmt: skip
        return events

    def message(self, response: generate_pb2.GenerateResponse) -> list[dict]:
        """The events for one `Generate` message: reasoning, text, then call pieces (the
        order vLLM splits a delta in)."""
        events = self.reasoning(response.reasoning_content) + self.delta(response.text)
        for piece in response.tool_calls:
            events += self.call(piece)
        return events

    def finish(self, status: str, usage: UsageSum) -> tuple[list[dict], dict]:
        """The closing events and the final response (also what the store keeps)."""
        events = [] if self.output or self.open else self._open_text("message")
        events += self._close(status)
        final = response_body(self.head, self.parsed, self.output, status, usage)
        events.append(self._event(TERMINAL.get(status, "response.failed"), response=final))
        return events, final

    @property
    def text(self) -> str:
        return "".join(part["text"] for item in self.output if item["type"] == "message"
                       for part in item["content"])  # fmt: skip

    def error(self, exc: ApiError) -> dict:
        return self._event("error", code=exc.code, message=exc.message, param=exc.param)
