"""Bounds on what an HTTP client may hold open or send before its request is read (the
slowloris defence): a connection must deliver a request's headers within
`header_timeout_s` of opening (or of its previous response: 408, then closed), a request's
head (request line and headers) may be at most `max_head_bytes` (431, then closed: the
gRPC API's metadata limit, common/grpc_server.py, so an oversized `Authorization` gets the
same answer on both APIs, right key or not), and at most `max_connections` connections are
open at once; past that, new ones are closed as soon as they are accepted. Time to deliver a
body is bounded where bodies are read (`request_body.read_json`). uvicorn has none of these
bounds (its keep-alive timer runs only between requests), so its h11 protocol is extended
here."""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from common.grpc_server import MAX_METADATA_BYTES
from common.log import get_logger

log = get_logger("services.openai_api")


def _response(status: str, error_type: str, message: str) -> bytes:
    """A whole OpenAI-shaped error response that closes the connection."""
    body = json.dumps(
        {"error": {"message": message, "type": error_type, "param": None, "code": None}}
    ).encode()
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def bounded_h11_protocol(
    header_timeout_s: float, max_connections: int, max_head_bytes: int = MAX_METADATA_BYTES
) -> type[H11Protocol]:
    """uvicorn's h11 protocol with these bounds (pass it as `uvicorn.Config(http=...)`)."""
    timeout_response = _response(
        "408 Request Timeout", "timeout_error", "request headers not received in time"
    )
    too_large_response = _response(
        "431 Request Header Fields Too Large",
        "invalid_request_error",
        f"request headers are larger than {max_head_bytes} bytes",
    )

    class BoundedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                log.warning("connection_refused", reason="max_connections", limit=max_connections)
                transport.abort()
                return
            self._await_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_header_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self.conn.their_state is h11.IDLE:  # still inside a request's head
                buffered = self.conn.trailing_data[0]
                if len(buffered) + len(data) > max_head_bytes:
                    end = (buffered + data).find(b"\r\n\r\n")
                    if end < 0 or end + 4 > max_head_bytes:
                        log.info("request_refused", reason="head_too_large", limit=max_head_bytes)
                        self._stop_header_timer()
                        self.transport.write(too_large_response)
                        self.transport.close()
                        return
            super().data_received(data)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is not h11.IDLE:  # this request's headers are in
                self._stop_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
                self._await_headers()  # the next request on this keep-alive connection

        def _await_headers(self) -> None:
            self._stop_header_timer()
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _stop_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            if self.conn.our_state is h11.IDLE:  # nothing sent on this request yet
                self.transport.write(timeout_response)
            log.info("connection_closed", reason="header_timeout", seconds=header_timeout_s)
            self.transport.close()

    return BoundedH11Protocol
