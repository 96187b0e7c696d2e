"""Bearer-token authentication for a gRPC server: a server interceptor that lets a call
through only when its metadata carries `authorization: Bearer <key>`, and answers every
other call with UNAUTHENTICATED before its request is even parsed.

Health and reflection stay open (probes and `grpcurl list` cannot send headers); every
other method of the server is protected. The token is compared in constant time.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterable, Sequence

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

from common.log import get_logger

UNAUTHENTICATED_MESSAGE = "missing or invalid bearer token"
OPEN_SERVICES = (health.SERVICE_NAME, reflection.SERVICE_NAME)

log = get_logger("common.auth")


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata that carries `token` (none when there is no token)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def _presented_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> bytes | None:
    for key, value in metadata or ():
        if key.lower() != "authorization":
            continue
        if isinstance(value, str):
            value = value.encode("utf-8", "replace")
        scheme, _, token = value.strip().partition(b" ")
        if scheme.lower() == b"bearer" and token.strip():
            return token.strip()
        return None
    return None


def _service_of(method: str) -> str:
    """'/pkg.Service/Method' -> 'pkg.Service'."""
    return method.lstrip("/").partition("/")[0]


def _discard(data: bytes) -> None:
    """An unauthenticated call's request is never parsed."""
    return None


async def _deny(request, context) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without the right bearer token, except to `open_services`."""

    def __init__(
        self,
        token: str,
        open_services: Sequence[str] = OPEN_SERVICES,
        on_denied: Callable[[str], None] | None = None,
    ) -> None:
        """`on_denied(method)` is called for each call refused (metrics)."""
        if not token:
            raise ValueError("the bearer token must not be empty")
        self._token = token.encode("utf-8")
        self._open = frozenset(open_services)
        self._on_denied = on_denied

    def authorized(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
        presented = _presented_token(metadata)
        # compare_digest over bytes takes time independent of where they differ.
        return presented is not None and hmac.compare_digest(presented, self._token)

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        if _service_of(method) in self._open or self.authorized(
            handler_call_details.invocation_metadata
        ):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None  # unknown method: UNIMPLEMENTED, as without auth
        log.warning("unauthenticated_call", method=method)
        if self._on_denied is not None:
            self._on_denied(method)
        serialize = handler.response_serializer
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(_deny, _discard, serialize)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(_deny, _discard, serialize)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(_deny, _discard, serialize)
        return grpc.stream_stream_rpc_method_handler(_deny, _discard, serialize)
