"""Server-sent events: the `data:` encoding, the chunk streams of both endpoints (an error
after the stream started is a final `{"error": ...}` event, then `[DONE]`), and a response
that cancels the gateway calls as soon as the client disconnects."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from starlette.responses import StreamingResponse

from common.log import get_logger
from services.openai_api.chat_response import ChatChunks
from services.openai_api.completion_response import CompletionChunks
from services.openai_api.errors import ApiError
from services.openai_api.gateway_client import GenerateStreams

DONE = b"data: [DONE]\n\n"
log = get_logger(__name__)


def encode(data: dict) -> bytes:
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return b"data: " + text.encode() + b"\n\n"


async def completion_chunks(streams: GenerateStreams, chunks: CompletionChunks):
    async for prompt_index, message in streams:
        chunk = chunks.chunk(prompt_index, message)
        if chunk is not None:
            yield chunk
    if (usage := chunks.usage_chunk()) is not None:
        yield usage


async def chat_chunks(streams: GenerateStreams, chunks: ChatChunks):
    for chunk in chunks.role_chunks():
        yield chunk
    async for _, message in streams:
        chunk = chunks.chunk(message)
        if chunk is not None:
            yield chunk
    if (usage := chunks.usage_chunk()) is not None:
        yield usage


async def events(chunks: AsyncIterator[dict], on_end: Callable[[str], None]):
    """Encoded events, then `[DONE]`; `on_end` gets "ok" or the error's message."""
    outcome = "ok"
    try:
        async for chunk in chunks:
            yield encode(chunk)
    except ApiError as exc:
        outcome = exc.message
        yield encode(exc.body())
    except Exception as exc:  # a bug here must still end the stream in the documented way
        log.exception("stream_failed")
        error = ApiError(f"internal error: {type(exc).__name__}", 500)
        outcome = error.message
        yield encode(error.body())
    on_end(outcome)
    yield DONE


class EventStreamResponse(StreamingResponse):
    """`text/event-stream`; `on_close` runs however the stream ends, also when the client
    disconnects mid-stream (Starlette cancels the sending task then)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            self.on_close()


def closing_stream(streams, make_events) -> EventStreamResponse:
    """A streamed answer that closes the `Generate` calls (`streams.close()`) however it
    ends; `make_events(on_end)` gives its events, calling `on_end(outcome)` when they end
    (a close without an outcome is the client going away)."""
    ended = []

    def on_end(outcome: str) -> None:
        ended.append(outcome)
        log.info("stream_finished", outcome=outcome)

    def on_close() -> None:
        if not ended:
            log.info("client_disconnected", streaming=True)
        streams.close()

    return EventStreamResponse(make_events(on_end), on_close=on_close)
