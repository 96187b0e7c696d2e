"""The Responses API routes: `POST /v1/responses` (streamed or not; `previous_response_id`
continues a stored conversation), `GET` and `DELETE /v1/responses/{response_id}` on the
store. A request becomes the chat-completions request of `parse_chat` and runs as one.
Stored responses belong to the credentials that stored them: others get the 404 an
unknown id gets (`param` naming the field: `previous_response_id` or `response_id`)."""

from __future__ import annotations

import hashlib
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.openai_api.chat_request import parse_chat
from services.openai_api.collect import UsageSum, finish_reason
from services.openai_api.errors import ApiError
from services.openai_api.gateway_client import GenerateStreams
from services.openai_api.request_body import credentials
from services.openai_api.response_store import ResponseStore, StoredResponse
from services.openai_api.responses_events import ResponseEvents, item_status
from services.openai_api.responses_request import ResponsesRequest, parse_responses
from services.openai_api.responses_response import (
    ResponseHead,
    deleted_body,
    output_items,
    response_body,
    response_id,
    status_of,
    stored_turn,
)
from services.openai_api.route_kit import RouteKit, event_stream


def owner_of(request: Request) -> str:
    """A digest of the client's credentials (none: the empty owner)."""
    value = "".join(v for _, v in credentials(request))
    return hashlib.sha256(value.encode()).hexdigest() if value else ""


def not_found(response_id: str, param: str) -> ApiError:
    what = "Previous response" if param == "previous_response_id" else "Response"
    code = "previous_response_not_found" if param == "previous_response_id" else None
    return ApiError(f"{what} with id '{response_id}' not found.", 404, param, code)


def responses_routes(kit: RouteKit, store: ResponseStore) -> list[Route]:
    def stored(request: Request, response_id: str, param: str) -> StoredResponse:
        entry = store.get(response_id)
        if entry is None or entry.owner != owner_of(request):
            raise not_found(response_id, param)
        return entry

    def keeper(request: Request, parsed: ResponsesRequest, history: tuple, head: ResponseHead):
        owner = owner_of(request)

        def keep(body: dict) -> None:
            if parsed.store:
                store.put(head.id, body, history, stored_turn(parsed, body["output"]), owner)

        return keep

    async def stream_events(streams: GenerateStreams, events: ResponseEvents, keep):
        for event in events.start():
            yield event["type"], event
        usage, finish = UsageSum(), None
        async for _, message in streams:
            usage.add(message)
            for event in events.message(message):
                yield event["type"], event
            finish = finish_reason(message) or finish
        closing, final = events.finish(status_of(finish), usage)
        keep(final)
        for event in closing:
            yield event["type"], event

    async def create(request: Request) -> Response:
        created = int(time.time())
        parsed = parse_responses(await kit.body(request))
        history: tuple = ()
        if parsed.previous_response_id is not None:
            previous = parsed.previous_response_id
            history = stored(request, previous, "previous_response_id").conversation
        chat = parse_chat(parsed.chat_body(history))
        model = await kit.model(request, chat, parsed.model)
        streams = await kit.open_streams(request, [chat.request])
        head = ResponseHead(response_id(streams.request_ids[0]), created, model)
        keep = keeper(request, parsed, history, head)
        if parsed.stream:
            events = ResponseEvents(head, parsed)
            return event_stream(
                streams,
                stream_events(streams, events, keep),
                lambda exc: ("error", events.error(exc)),
            )
        collected = await kit.collect(request, streams)
        (choice,) = collected.sorted_choices()
        status = status_of(choice.finish_reason)
        output = output_items(choice.text, choice.parsed, item_status(status))
        body = response_body(head, parsed, output, status, collected.usage)
        keep(body)
        return JSONResponse(body)

    async def authorized(request: Request) -> None:
        """The gateway's verdict on the client's credentials (a model list call), as for
        every request that generates."""
        await kit.gateway.list_models(credentials(request))

    async def retrieve(request: Request) -> Response:
        await authorized(request)
        response_id = request.path_params["response_id"]
        return JSONResponse(stored(request, response_id, "response_id").body)

    async def delete(request: Request) -> Response:
        await authorized(request)
        response_id = request.path_params["response_id"]
        stored(request, response_id, "response_id")
        store.delete(response_id)
        return JSONResponse(deleted_body(response_id))

    return [
        Route("/v1/responses", create, methods=["POST"]),
        Route("/v1/responses/{response_id}", retrieve, methods=["GET"]),
        Route("/v1/responses/{response_id}", delete, methods=["DELETE"]),
    ]
