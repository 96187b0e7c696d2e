"""What every route reads off an HTTP request: the client's credentials (its
`Authorization` header, passed to the gateway as call metadata) and the size- and
depth-limited JSON body (413 above the size limit; 400 when it nests deeper than
MAX_JSON_DEPTH or does not parse)."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request

from common.json_depth import JsonTooDeep, load_json
from services.openai_api.errors import ApiError
from services.openai_api.gateway_client import Metadata

DRAIN_FACTOR = 4
BODY_TIMEOUT_S = 60.0  # unless the app's state says otherwise (--body-timeout-s)
# Deepest nesting of arrays/objects a body may have (docs/openai_api.md, "Limits"). Real
# requests nest under 10 levels, a JSON schema inside one at most 64 more (the gateway's
# schema limit); Python's recursive parser would fail near 1,000.
MAX_JSON_DEPTH = 128


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
    """The request body as JSON: 413 above `limit` bytes, 408 when it is not all in within
    the body timeout, 400 when it nests deeper than MAX_JSON_DEPTH or does not parse.

    A body over the limit is still read (and dropped), up to DRAIN_FACTOR times the limit,
    so that a client which sends it all before reading gets the 413 instead of a reset."""
    length = request.headers.get("content-length", "")
    too_large = length.isdigit() and int(length) > limit
    body = bytearray()
    received = 0
    timeout_s = getattr(request.app.state, "body_timeout_s", BODY_TIMEOUT_S)
    try:
        async with asyncio.timeout(timeout_s):
            async for piece in request.stream():
                received += len(piece)
                too_large = too_large or received > limit
                if too_large and received > DRAIN_FACTOR * limit:
                    break
                if not too_large:
                    body += piece
    except TimeoutError:
        raise ApiError(f"request body not received within {timeout_s:g} s", 408) from None
    if too_large:
        raise ApiError(f"request body is larger than {limit} bytes", 413)
    try:
        return load_json(body, MAX_JSON_DEPTH, "request body", parse_constant=_reject_constant)
    except JsonTooDeep as exc:
        raise ApiError(str(exc), 400) from None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ApiError(f"request body is not valid JSON: {exc}", 400) from None
