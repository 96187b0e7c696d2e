"""vLLM's run-time LoRA endpoints: `POST /v1/load_lora_adapter` with `{"lora_name",
"lora_path"}` and `POST /v1/unload_lora_adapter` with `{"lora_name"}`, answered as vLLM
does (200 with a plain-text confirmation; errors OpenAI-shaped: 400 for a bad or taken
name, a folder that is not an adapter, or updating turned off at the gateway; 404 for
unloading an adapter that is not served). The gateway checks and carries them out; a
loaded adapter is then a `model` requests may name and `/v1/models` lists."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from services.openai_api.errors import invalid
from services.openai_api.gateway_client import GatewayClient
from services.openai_api.request_body import credentials, read_json

MAX_BODY_BYTES = 64 * 1024


def _field(body, name: str) -> str:
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, str) or not value:
        raise invalid(name, "is required (a non-empty string)")
    return value


def lora_routes(gateway: GatewayClient) -> list[Route]:

    async def load(request: Request) -> Response:
        body = await read_json(request, MAX_BODY_BYTES)
        name, path = _field(body, "lora_name"), _field(body, "lora_path")
        await gateway.load_lora_adapter(name, path, credentials(request))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(request: Request) -> Response:
        body = await read_json(request, MAX_BODY_BYTES)
        name = _field(body, "lora_name")
        await gateway.unload_lora_adapter(name, credentials(request))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    return [
        Route("/v1/load_lora_adapter", load, methods=["POST"]),
        Route("/v1/unload_lora_adapter", unload, methods=["POST"]),
    ]
