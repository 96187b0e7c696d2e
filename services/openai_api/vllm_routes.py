"""vLLM's utility endpoints beside the OpenAI API: `POST /tokenize` and `POST /detokenize`
(through the gateway's `Tokenize` and `Detokenize`, with the client's credentials, the
`model` resolved as on every endpoint: unknown is a 404) and `GET /version`
(`{"version"}`: Tandem's package version)."""

from __future__ import annotations

import importlib.metadata

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.openai_api.gateway_client import GatewayClient
from services.openai_api.request_body import credentials, read_json
from services.openai_api.tokenize_request import (
    check_vocabulary,
    parse_detokenize,
    parse_tokenize,
    tokenize_body,
)


def tandem_version() -> str:
    try:
        return importlib.metadata.version("tandem")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout never installed
        return "unknown"


def vllm_routes(gateway: GatewayClient, max_body_bytes: int) -> list[Route]:
    version = {"version": tandem_version()}

    async def tokenize(request: Request) -> Response:
        call = parse_tokenize(await read_json(request, max_body_bytes))
        await gateway.resolve_model(call.model, credentials(request))
        reply = await gateway.tokenize(call.request, credentials(request))
        return JSONResponse(tokenize_body(reply, call.return_token_strs))

    async def detokenize(request: Request) -> Response:
        call = parse_detokenize(await read_json(request, max_body_bytes))
        model = await gateway.resolve_model(call.model, credentials(request))
        info = await gateway.model_info(model, credentials(request))
        check_vocabulary(call.tokens, info.vocab_size)
        text = await gateway.detokenize(call.tokens, credentials(request))
        return JSONResponse({"prompt": text})

    async def get_version(request: Request) -> Response:
        return JSONResponse(version)

    return [
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/version", get_version, methods=["GET"]),
    ]
