"""OpenAI-shaped errors: the exception the HTTP layer raises, its JSON body, and the mapping
from gRPC status codes (the gateway's answers) to HTTP status codes. Pure."""

from __future__ import annotations

from typing import Any

import grpc

# gRPC status -> HTTP status; anything not listed is 500.
HTTP_STATUS_FROM_GRPC = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}

# HTTP status -> OpenAI error `type`.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class ApiError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": ERROR_TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }


def invalid(param: str, message: str, code: str = "invalid_value") -> ApiError:
    """A 400 about one request field; the message starts with the field's name."""
    return ApiError(f"{param}: {message}" if message else param, 400, param=param, code=code)


def from_rpc_error(code: grpc.StatusCode, details: str | None) -> ApiError:
    """The gateway's status and message as an HTTP error (the message passes through)."""
    return ApiError(
        details or code.name.lower(),
        HTTP_STATUS_FROM_GRPC.get(code, 500),
        code=code.name.lower(),
    )
