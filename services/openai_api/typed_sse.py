"""Server-sent events with a name per event (`event: <type>` then `data: <json>`), as the
Responses API and Anthropic's Messages API send them (no `[DONE]`): the encoding, and the
byte stream of a route's events that ends with the API's own error event when something
fails after the stream started."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from common.log import get_logger
from services.openai_api.errors import ApiError

log = get_logger(__name__)
Event = tuple[str, dict]  # (event name, data)


def encode_event(name: str, data: dict) -> bytes:
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"event: {name}\ndata: {text}\n\n".encode()


async def typed_events(
    events: AsyncIterator[Event],
    on_error: Callable[[ApiError], Event],
    on_end: Callable[[str], None],
) -> AsyncIterator[bytes]:
    """Encoded events; an error is `on_error`'s event. `on_end` gets "ok" or the error."""
    outcome = "ok"
    try:
        async for name, data in events:
            yield encode_event(name, data)
    except ApiError as exc:
        outcome = exc.message
        yield encode_event(*on_error(exc))
    except Exception as exc:  # a bug here must still end the stream with an error event
        log.exception("stream_failed")
        error = ApiError(f"internal error: {type(exc).__name__}", 500)
        outcome = error.message
        yield encode_event(*on_error(error))
    on_end(outcome)
