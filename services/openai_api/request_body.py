"""What every route reads off an HTTP request: the client's credentials (its
`Authorization` header, passed to the gateway as call metadata) and the size-limited JSON
body (413 above the limit, 400 when it does not parse)."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from services.openai_api.errors import ApiError
from services.openai_api.gateway_client import Metadata

DRAIN_FACTOR = 4


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def credentials(request: Request) -> Metadata:
    """The client's `Authorization` header as gRPC metadata. A value gRPC cannot carry
    (not printable ASCII) is dropped: the gateway then sees no credentials."""
    value = request.headers.get("authorization", "").strip()
    if not value or not value.isascii() or not value.isprintable():
        return ()
    return (("authorization", value),)


async def read_json(request: Request, limit: int) -> Any:
    """The request body as JSON: 413 above `limit` bytes, 400 when it does not parse.

    A body over the limit is still read (and dropped), up to DRAIN_FACTOR times the limit,
    so that a client which sends it all before reading gets the 413 instead of a reset."""
    length = request.headers.get("content-length", "")
    too_large = length.isdigit() and int(length) > limit
    body = bytearray()
    received = 0
    async for piece in request.stream():
        received += len(piece)
        too_large = too_large or received > limit
        if too_large and received > DRAIN_FACTOR * limit:
            break
        if not too_large:
            body += piece
    if too_large:
        raise ApiError(f"request body is larger than {limit} bytes", 413)
    try:
        return json.loads(body, parse_constant=_reject_constant)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ApiError(f"request body is not valid JSON: {exc}", 400) from None
