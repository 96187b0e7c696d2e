"""What the Responses and Messages routes share with the chat route in `app.py`: the
gateway, the body limit and app.py's stream handling (open the `Generate` calls, await
with disconnects watched), plus the steps every such route takes — the model and LoRA
adapter of a chat request, a finished request collected, a typed event stream returned."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from common.log import get_logger
from common.pb.tandem.v1 import generate_pb2
from services.openai_api.chat_request import ChatRequest
from services.openai_api.collect import Collector
from services.openai_api.gateway_client import GatewayClient, GenerateStreams
from services.openai_api.request_body import credentials, read_json
from services.openai_api.sse import EventStreamResponse, closing_stream
from services.openai_api.typed_sse import Event, typed_events

log = get_logger("services.openai_api")


@dataclass(frozen=True)
class RouteKit:
    gateway: GatewayClient
    max_body_bytes: int
    # app.py's: the Generate calls opened (their first messages in), an await cancelled
    # when the client disconnects, and the same that closes the calls on any failure.
    open_streams: Callable[[Request, Sequence[generate_pb2.GenerateRequest]],
                           Awaitable[GenerateStreams]]  # fmt: skip
    until_disconnect: Callable[[Request, Awaitable[Any]], Awaitable[Any]]
    while_open: Callable[[Request, GenerateStreams, Awaitable[Any]], Awaitable[Any]]

    async def body(self, request: Request) -> Any:
        return await read_json(request, self.max_body_bytes)

    async def model(self, request: Request, chat: ChatRequest, name: str | None) -> str:
        """The served model `name` resolves to (404 when unknown); sets the chat request's
        LoRA adapter when it names one."""
        model = await self.gateway.resolve_model(name, credentials(request))
        chat.request.lora_name = await self.gateway.lora_name(model, credentials(request))
        return model

    async def prompt_tokens(
        self, request: Request, streams: GenerateStreams, chat: ChatRequest
    ) -> int:
        """How many tokens the rendered conversation is, with its tools (`Tokenize`, the
        gateway's one chat template path), while the calls are open."""
        ask = generate_pb2.TokenizeRequest(chat=chat.request.chat, tools=chat.request.tools)
        reply = await self.while_open(
            request, streams, self.gateway.tokenize(ask, credentials(request))
        )
        return len(reply.token_ids)

    async def collect(self, request: Request, streams: GenerateStreams) -> Collector:
        async def read() -> Collector:
            collector = Collector(1)
            async for prompt_index, message in streams:
                collector.add(prompt_index, message)
            return collector

        return await self.until_disconnect(request, read())


def event_stream(
    streams: GenerateStreams,
    events: AsyncIterator[Event],
    on_error: Callable[[Any], Event],
) -> EventStreamResponse:
    """The typed SSE response; the Generate calls close however it ends."""
    return closing_stream(streams, lambda on_end: typed_events(events, on_error, on_end))
