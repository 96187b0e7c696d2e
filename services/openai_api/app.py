"""The Starlette application: thin route handlers that read the JSON body (`request_body.py`),
translate it (`*_request.py`), call the gateway (`gateway_client.py`) and translate the
answer back (`*_response.py`, `sse.py`). Every error leaves as OpenAI-shaped JSON.

The client's `Authorization` header goes to the gateway as call metadata; the gateway checks
it (UNAUTHENTICATED becomes a 401). `/health`, `/metrics` (Prometheus), vLLM's `/ping`
(GET or POST, the same answer) and `/version` need none. With tracing on, each request is a
span (`http_trace.py`) that the Generate calls carry to the gateway."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

import structlog
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from common.log import get_logger
from common.pb.tandem.v1 import generate_pb2
from common.tracing import current_trace_id, enabled, outgoing_metadata
from services.openai_api.chat_request import ChatRequest, parse_chat
from services.openai_api.chat_response import ChatChunks, chat_body
from services.openai_api.collect import Collector, Meta
from services.openai_api.completion_request import CompletionRequest, parse_completion
from services.openai_api.completion_response import CompletionChunks, Echo, completion_body
from services.openai_api.errors import ApiError
from services.openai_api.gateway_client import GatewayClient, GenerateStreams, Metadata
from services.openai_api.http_trace import HttpTracing
from services.openai_api.lora_routes import lora_routes
from services.openai_api.messages_routes import messages_routes
from services.openai_api.metrics import HttpMetrics, metrics_endpoint
from services.openai_api.request_body import credentials, read_json
from services.openai_api.response_store import ResponseStore
from services.openai_api.responses_routes import responses_routes
from services.openai_api.route_kit import RouteKit
from services.openai_api.sse import (
    EventStreamResponse,
    chat_chunks,
    closing_stream,
    completion_chunks,
    events,
)
from services.openai_api.vllm_routes import vllm_routes

log = get_logger("services.openai_api")
T = TypeVar("T")
CLIENT_CLOSED = 499  # nginx's code for "the client went away"; nobody receives it
DEFAULT_STORE_BYTES, DEFAULT_STORE_TTL_S = 256 << 20, 3600.0  # as config.py's defaults


class ClientDisconnected(Exception):
    pass


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()  # its own cleanup cancels the gateway calls
    if not task.done():
        raise ClientDisconnected
    return task.result()


async def collect(streams: GenerateStreams, collector: Collector) -> Collector:
    async for prompt_index, message in streams:
        collector.add(prompt_index, message)
    return collector


def _stream_response(streams: GenerateStreams, chunks) -> EventStreamResponse:
    return closing_stream(streams, lambda on_end: events(chunks, on_end))


async def _echo_texts(
    gateway: GatewayClient, parsed: CompletionRequest, metadata: Metadata
) -> list[str] | None:
    if not parsed.echo:
        return None
    return [
        p if isinstance(p, str) else await gateway.detokenize(p, metadata) for p in parsed.prompts
    ]


async def _completion_prompt_ids(
    gateway: GatewayClient, parsed: CompletionRequest, metadata: Metadata
) -> list[list[int]] | None:
    """Each prompt's token ids for `return_token_ids` (text through `Tokenize`, which
    tokenizes exactly as `Generate` does)."""
    if not parsed.options.return_token_ids:
        return None

    async def ids(prompt) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        reply = await gateway.tokenize(generate_pb2.TokenizeRequest(text=prompt), metadata)
        return list(reply.token_ids)

    return list(await asyncio.gather(*(ids(p) for p in parsed.prompts)))


async def _chat_prompt_ids(
    gateway: GatewayClient, parsed: ChatRequest, metadata: Metadata
) -> list[int] | None:
    """The rendered conversation's token ids for `return_token_ids` (the gateway's one chat
    template path renders it for `Tokenize` as for `Generate`)."""
    if not parsed.options.return_token_ids:
        return None
    request = generate_pb2.TokenizeRequest(chat=parsed.request.chat, tools=parsed.request.tools)
    return list((await gateway.tokenize(request, metadata)).token_ids)


async def _eos_ids(
    gateway: GatewayClient, model: str, requests, metadata: Metadata
) -> frozenset[int]:
    """The model's end-of-sequence ids that no request lists in `stop_token_ids`: a stop
    on one of them has no `stop_reason` (as in vLLM)."""
    info = await gateway.model_info(model, metadata)
    listed = {i for r in requests for i in r.stopping.stop_token_ids}
    return frozenset(info.eos_token_ids) - listed


async def _echo(
    gateway: GatewayClient, parsed: CompletionRequest, texts: list[str] | None, metadata: Metadata
) -> Echo | None:
    """What echo adds to the answer (with logprobs: each prompt's first token, which no
    logprob covers, as the gateway writes logprob tokens)."""
    if texts is None:
        return None
    first = None
    if parsed.echo_logprobs:
        first = [await gateway.first_token(p, metadata) for p in parsed.prompts]
    return Echo(texts, first, parsed.logprobs or 0, parsed.echo_only)


def create_app(
    gateway: GatewayClient, max_body_bytes: int, response_store: ResponseStore | None = None
) -> Starlette:
    started = int(time.time())
    if response_store is None:
        response_store = ResponseStore(DEFAULT_STORE_BYTES, DEFAULT_STORE_TTL_S)

    async def open_streams(request: Request, requests) -> GenerateStreams:
        # The HTTP span (when traced) goes to the gateway as the calls' traceparent.
        streams = gateway.generate(requests, (*credentials(request), *outgoing_metadata()))
        await until_disconnect(request, streams.start())
        # Its lines carry the gateway's request id and, when traced, the HTTP span's trace.
        trace_id = current_trace_id()
        if trace_id:
            structlog.contextvars.bind_contextvars(trace_id=trace_id)
        structlog.contextvars.bind_contextvars(request_id=streams.request_ids[0])
        return streams

    async def while_open(request: Request, streams: GenerateStreams, work: Awaitable[T]) -> T:
        """Await `work` with the streams open; any failure closes them."""
        try:
            return await until_disconnect(request, work)
        except BaseException:
            streams.close()
            raise

    async def completions(request: Request) -> Response:
        created = int(time.time())
        parsed = parse_completion(await read_json(request, max_body_bytes))
        options = parsed.options
        model = await gateway.resolve_model(options.model, credentials(request))
        lora = await gateway.lora_name(model, credentials(request))
        for each in parsed.requests:
            each.lora_name = lora
        echo_texts = await _echo_texts(gateway, parsed, credentials(request))
        streams = await open_streams(request, parsed.requests)
        prompt_ids = await while_open(
            request, streams, _completion_prompt_ids(gateway, parsed, credentials(request))
        )
        eos = await _eos_ids(gateway, model, parsed.requests, credentials(request))
        meta = Meta(f"cmpl-{streams.request_ids[0]}", created, model, eos)
        logprobs = parsed.logprobs is not None
        if options.stream:
            chunks = CompletionChunks(
                meta, options.n, echo_texts, logprobs, options.include_usage,
                prompt_ids, options.tokens_as_ids,
            )  # fmt: skip
            return _stream_response(streams, completion_chunks(streams, chunks))
        collected = await until_disconnect(
            request, collect(streams, Collector(options.n, meta.eos_ids))
        )
        echo = await _echo(gateway, parsed, echo_texts, credentials(request))
        body = completion_body(
            meta, collected, echo, logprobs, options.prompt_logprobs is not None,
            prompt_ids, options.tokens_as_ids,
        )  # fmt: skip
        return JSONResponse(body)

    async def chat_completions(request: Request) -> Response:
        created = int(time.time())
        parsed = parse_chat(await read_json(request, max_body_bytes))
        options = parsed.options
        model = await gateway.resolve_model(options.model, credentials(request))
        parsed.request.lora_name = await gateway.lora_name(model, credentials(request))
        streams = await open_streams(request, [parsed.request])
        prompt_ids = await while_open(
            request, streams, _chat_prompt_ids(gateway, parsed, credentials(request))
        )
        eos = await _eos_ids(gateway, model, [parsed.request], credentials(request))
        meta = Meta(f"chatcmpl-{streams.request_ids[0]}", created, model, eos)
        if options.stream:
            chunks = ChatChunks(
                meta, options.n, parsed.logprobs, options.include_usage,
                prompt_ids, options.tokens_as_ids,
            )  # fmt: skip
            return _stream_response(streams, chat_chunks(streams, chunks))
        collected = await until_disconnect(
            request, collect(streams, Collector(options.n, meta.eos_ids))
        )
        body = chat_body(
            meta, collected, parsed.logprobs, options.prompt_logprobs is not None,
            prompt_ids, options.tokens_as_ids,
        )  # fmt: skip
        return JSONResponse(body)

    def model_card(model) -> dict:
        return {
            "id": model.model_name,
            "object": "model",
            "created": started,
            "owned_by": "tandem",
            "root": model.model_name,
            "parent": None,
            "max_model_len": model.max_model_len,
        }

    def cards(models) -> list[dict]:
        """Each model name, then each LoRA adapter (parent: the first name of its model, as
        vLLM lists them)."""
        out, listed = [], set()
        for m in models:
            out.append(model_card(m))
            for name in m.lora_adapters:
                if name not in listed:
                    listed.add(name)
                    out.append(model_card(m) | {"id": name, "root": name, "parent": m.model_name})
        return out

    async def list_models(request: Request) -> Response:
        models = await gateway.list_models(credentials(request))
        return JSONResponse({"object": "list", "data": cards(models)})

    async def get_model(request: Request) -> Response:
        name = request.path_params["model"]
        await gateway.resolve_model(name, credentials(request))
        models = await gateway.list_models(credentials(request))
        return JSONResponse(next(c for c in cards(models) if c["id"] == name))

    async def health(request: Request) -> Response:
        if await gateway.serving():
            return JSONResponse({"status": "ok"})
        # Not logged: probes poll this while the stack starts.
        return JSONResponse(ApiError("the gateway is not serving", 503).body(), status_code=503)

    # The Responses and Messages APIs run as chat requests on the same stream handling.
    kit = RouteKit(gateway, max_body_bytes, open_streams, until_disconnect, while_open)
    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", get_model, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/ping", health, methods=["GET", "POST"]),  # vLLM's (SageMaker's) probe
            Route("/metrics", metrics_endpoint, methods=["GET"]),
            *lora_routes(gateway),
            *vllm_routes(gateway, max_body_bytes),
            *responses_routes(kit, response_store),
            *messages_routes(kit),
        ],
        middleware=[Middleware(HttpMetrics)] + ([Middleware(HttpTracing)] if enabled() else []),
        exception_handlers={
            ApiError: on_api_error,
            ClientDisconnected: on_client_disconnected,
            ClientDisconnect: on_client_disconnected,  # gone while its body was being read
            HTTPException: on_http_error,
            Exception: on_internal_error,
        },
    )


async def on_api_error(request: Request, exc: ApiError) -> Response:
    log.info("request_failed", path=request.url.path, status=exc.status, error=exc.message)
    # RFC 6750: a 401 names the scheme the client must use.
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def on_client_disconnected(request: Request, exc: Exception) -> Response:
    """The client left (mid-body or while waiting): its doing, logged at info, no trace."""
    log.info("client_disconnected", path=request.url.path)
    return Response(status_code=CLIENT_CLOSED)


async def on_http_error(request: Request, exc: HTTPException) -> Response:
    error = ApiError(str(exc.detail), exc.status_code)
    return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)


async def on_internal_error(request: Request, exc: Exception) -> Response:
    log.exception("internal_error", path=request.url.path)
    error = ApiError(f"internal error: {type(exc).__name__}", 500)
    return JSONResponse(error.body(), status_code=500)
