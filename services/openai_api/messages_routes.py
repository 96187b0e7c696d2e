"""Anthropic's Messages API route, `POST /v1/messages` (streamed or not): the body becomes
the chat-completions request of `parse_chat` and runs as one; answers and errors are in
Anthropic's shapes (an `ApiError` here is answered as Anthropic's error, its status kept)."""

from __future__ import annotations

import functools

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from common.log import get_logger
from services.openai_api.chat_request import ChatRequest, parse_chat
from services.openai_api.collect import UsageSum, finish_reason, stop_reason
from services.openai_api.errors import ApiError
from services.openai_api.gateway_client import GenerateStreams
from services.openai_api.messages_events import MessageEvents
from services.openai_api.messages_request import parse_messages
from services.openai_api.messages_response import (
    MessageHead,
    content_blocks,
    error_body,
    message_body,
    message_id,
    stop_of,
    usage_body,
)
from services.openai_api.route_kit import RouteKit, event_stream

log = get_logger("services.openai_api")


def anthropic_errors(handler):
    @functools.wraps(handler)
    async def answer(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as exc:
            log.info("request_failed", path=request.url.path, status=exc.status,
                     error=exc.message)  # fmt: skip
            return JSONResponse(error_body(exc), status_code=exc.status)

    return answer


def messages_routes(kit: RouteKit) -> list[Route]:
    async def stream_events(streams: GenerateStreams, events: MessageEvents, input_tokens: int):
        for item in events.start(input_tokens):
            yield item
        usage, stop = UsageSum(), (None, None)
        async for _, message in streams:
            usage.add(message)
            for item in events.message(message):
                yield item
            if finish_reason(message) is not None:
                stop = (finish_reason(message), stop_reason(message))
        for item in events.finish(stop_of(*stop, events.tool_used), usage):
            yield item

    async def streamed(request: Request, streams: GenerateStreams, chat: ChatRequest, head):
        input_tokens = await kit.prompt_tokens(request, streams, chat)
        events = MessageEvents(head)
        return event_stream(streams, stream_events(streams, events, input_tokens), events.error)

    @anthropic_errors
    async def create(request: Request) -> Response:
        parsed = parse_messages(await kit.body(request))
        chat = parse_chat(parsed.chat)
        model = await kit.model(request, chat, parsed.model)
        streams = await kit.open_streams(request, [chat.request])
        head = MessageHead(message_id(streams.request_ids[0]), model)
        if parsed.stream:
            return await streamed(request, streams, chat, head)
        collected = await kit.collect(request, streams)
        (choice,) = collected.sorted_choices()
        calls = bool(choice.parsed is not None and choice.parsed.tool_calls)
        stop = stop_of(choice.finish_reason, choice.stop_reason, calls)
        content = content_blocks(choice.text, choice.parsed)
        body = message_body(head, content, stop, usage_body(collected.usage))
        return JSONResponse(body)

    return [Route("/v1/messages", create, methods=["POST"])]
