"""Requests that do not parse (bad UTF-8 in a string field, corrupt wire format) fail with
INVALID_ARGUMENT naming the message type, instead of grpc's default UNKNOWN.

A server interceptor swaps each method's deserializer for one that turns a parse error into
a `MalformedRequest` value, and wraps the method so that value aborts the call before the
servicer sees it. Works for all four RPC shapes, for handlers that yield their responses
and for those that write them with `context.write`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import grpc


@dataclass(frozen=True)
class MalformedRequest:
    error: str


def _message(request: MalformedRequest, method: str) -> str:
    return f"{method}: the request is not a valid protobuf message: {request.error}"


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        deserialize = handler.request_deserializer

        def tolerant(data: bytes):
            try:
                return deserialize(data)
            except Exception as exc:  # DecodeError and friends
                return MalformedRequest(str(exc))

        async def reject(request, context) -> None:
            if isinstance(request, MalformedRequest):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _message(request, method))

        async def checked(requests, context):
            async for request in requests:
                await reject(request, context)
                yield request

        serialize = handler.response_serializer
        if handler.unary_unary:
            inner_uu = handler.unary_unary

            async def unary_unary(request, context):
                await reject(request, context)
                return await inner_uu(request, context)

            return grpc.unary_unary_rpc_method_handler(unary_unary, tolerant, serialize)
        if handler.unary_stream:
            inner_us = handler.unary_stream
            if inspect.isasyncgenfunction(inner_us):

                async def unary_stream(request, context):
                    await reject(request, context)
                    async for response in inner_us(request, context):
                        yield response

            else:

                async def unary_stream(request, context):
                    await reject(request, context)
                    return await inner_us(request, context)

            return grpc.unary_stream_rpc_method_handler(unary_stream, tolerant, serialize)
        if handler.stream_unary:
            inner_su = handler.stream_unary

            async def stream_unary(requests, context):
                return await inner_su(checked(requests, context), context)

            return grpc.stream_unary_rpc_method_handler(stream_unary, tolerant, serialize)
        inner_ss = handler.stream_stream
        if inspect.isasyncgenfunction(inner_ss):

            async def stream_stream(requests, context):
                async for response in inner_ss(checked(requests, context), context):
                    yield response

        else:

            async def stream_stream(requests, context):
                return await inner_ss(checked(requests, context), context)

        return grpc.stream_stream_rpc_method_handler(stream_stream, tolerant, serialize)
