"""The gateway's public gRPC API as the HTTP layer uses it (grpc.aio on the server's event
loop): served models (cached briefly), tokenization (`/tokenize`, `return_token_ids`),
detokenization (`echo`, `/detokenize`), health, and concurrent `Generate` streams merged
into one. gRPC errors come out as `ApiError`s.

Every call but health carries the HTTP client's credentials as gRPC metadata
(`Metadata`, from its `Authorization` header): the gateway decides, and the model list is
cached per credential so it never answers a client the gateway would refuse."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.pb.tandem.v1 import generate_pb2, generate_pb2_grpc
from services.openai_api.errors import ApiError, from_rpc_error

UNARY_TIMEOUT_S = 10.0
MODELS_TTL_S = 5.0
MODELS_RECHECK_S = 0.5  # a name not served: asked again when the list is older than this
MODELS_CACHE_ENTRIES = 64

# gRPC call metadata: (key, value) pairs.
Metadata = tuple[tuple[str, str], ...]


def api_error(exc: grpc.aio.AioRpcError) -> ApiError:
    return from_rpc_error(exc.code(), exc.details())


def _serves(models, name: str) -> bool:
    return any(m.model_name == name or name in m.lora_adapters for m in models)


class GenerateStreams:
    """One `Generate` call per request, read concurrently and merged into one stream of
    (request index, message). `start()` waits for every call's first message, so a request
    the gateway rejects becomes an HTTP error before any response byte is sent.
    `close()` cancels every call (the gateway then aborts the requests)."""

    def __init__(
        self,
        stub: generate_pb2_grpc.GenerateServiceStub,
        requests: Sequence[generate_pb2.GenerateRequest],
        metadata: Metadata = (),
    ) -> None:
        self._calls = [stub.Generate(request, metadata=metadata) for request in requests]
        self._tasks: list[asyncio.Task] = []
        self._first: list[generate_pb2.GenerateResponse] = []
        self._queue: asyncio.Queue = asyncio.Queue()

    @property
    def request_ids(self) -> list[str]:
        return [message.request_id for message in self._first]

    async def start(self) -> None:
        reads = [asyncio.ensure_future(call.read()) for call in self._calls]
        self._tasks.extend(reads)
        try:
            await asyncio.wait(reads, return_when=asyncio.FIRST_EXCEPTION)
            errors = [r.exception() for r in reads if r.done() and r.exception() is not None]
            if errors:
                raise errors[0]
        except grpc.aio.AioRpcError as exc:
            self.close()
            raise api_error(exc) from None
        except BaseException:
            self.close()
            raise
        self._first = [read.result() for read in reads]
        if any(message is grpc.aio.EOF for message in self._first):
            self.close()
            raise ApiError("the gateway ended a Generate stream without a message", 502)
        self._tasks = [
            asyncio.create_task(self._pump(index, call)) for index, call in enumerate(self._calls)
        ]

    async def _pump(self, index: int, call) -> None:
        try:
            while (message := await call.read()) is not grpc.aio.EOF:
                self._queue.put_nowait((index, message))
            self._queue.put_nowait((index, None))
        except grpc.aio.AioRpcError as exc:
            self._queue.put_nowait((index, exc))

    async def __aiter__(self) -> AsyncIterator[tuple[int, generate_pb2.GenerateResponse]]:
        try:
            for index, message in enumerate(self._first):
                yield index, message
            open_streams = len(self._calls)
            while open_streams:
                index, item = await self._queue.get()
                if item is None:
                    open_streams -= 1
                elif isinstance(item, grpc.aio.AioRpcError):
                    raise api_error(item)
                else:
                    yield index, item
        finally:
            self.close()

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for call in self._calls:
            call.cancel()  # no-op once finished


def renamed(
    models: list[generate_pb2.GetModelInfoResponse], names: tuple[str, ...]
) -> list[generate_pb2.GetModelInfoResponse]:
    """The gateway's model under this front's own served names (its --served-model-name):
    one entry per name, each a copy of the gateway's first model."""
    if not names or not models:
        return models
    out = []
    for name in names:
        model = generate_pb2.GetModelInfoResponse()
        model.CopyFrom(models[0])
        model.model_name = name
        out.append(model)
    return out


class GatewayClient:
    def __init__(self, channel: grpc.aio.Channel, served_model_names: tuple[str, ...] = ()) -> None:
        self.served_model_names = served_model_names
        self.stub = generate_pb2_grpc.GenerateServiceStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)
        # credentials -> (fetched at, models): only answers the gateway gave them.
        self._models: dict[Metadata, tuple[float, list[generate_pb2.GetModelInfoResponse]]] = {}

    async def list_models(
        self, metadata: Metadata = (), max_age_s: float = MODELS_TTL_S
    ) -> list[generate_pb2.GetModelInfoResponse]:
        fetched_at, models = self._models.get(metadata, (float("-inf"), []))
        if time.monotonic() - fetched_at > max_age_s:
            try:
                reply = await self.stub.ListModels(
                    generate_pb2.ListModelsRequest(), timeout=UNARY_TIMEOUT_S, metadata=metadata
                )
            except grpc.aio.AioRpcError as exc:
                self._models.pop(metadata, None)
                raise api_error(exc) from None
            if len(self._models) >= MODELS_CACHE_ENTRIES:
                self._models.clear()
            models = renamed(list(reply.models), self.served_model_names)
            self._models[metadata] = (time.monotonic(), models)
        return models

    async def resolve_model(self, name: str | None, metadata: Metadata = ()) -> str:
        """The served model's id: `name` when served, as a model or one of its LoRA adapters
        (404 otherwise), the first one if None."""
        models = await self.list_models(metadata)
        if not models:
            raise ApiError("the gateway serves no model yet", 503)
        if name is None:
            return models[0].model_name
        if not _serves(models, name):  # an adapter loaded since, maybe: ask again
            models = await self.list_models(metadata, max_age_s=MODELS_RECHECK_S)
        if _serves(models, name):
            return name
        raise ApiError(
            f"The model `{name}` does not exist. Served: "
            + ", ".join(n for m in models for n in (m.model_name, *m.lora_adapters)),
            404,
            "model",
            "model_not_found",
        )

    async def model_info(
        self, model: str, metadata: Metadata = ()
    ) -> generate_pb2.GetModelInfoResponse:
        """The served model a resolved id stands for (a LoRA adapter's: its base model)."""
        for m in await self.list_models(metadata):
            if m.model_name == model or model in m.lora_adapters:
                return m
        raise ApiError(f"The model `{model}` does not exist", 404, "model", "model_not_found")

    async def lora_name(self, model: str, metadata: Metadata = ()) -> str:
        """The LoRA adapter a resolved model id stands for ("" = a base model), as vLLM
        selects adapters by the request's `model`."""
        models = await self.list_models(metadata)
        if any(m.model_name == model for m in models):
            return ""
        return model if any(model in m.lora_adapters for m in models) else ""

    async def load_lora_adapter(self, name: str, path: str, metadata: Metadata = ()) -> None:
        request = generate_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path)
        await self._lora_call(self.stub.LoadLoraAdapter, request, metadata)

    async def unload_lora_adapter(self, name: str, metadata: Metadata = ()) -> None:
        request = generate_pb2.UnloadLoraAdapterRequest(lora_name=name)
        await self._lora_call(self.stub.UnloadLoraAdapter, request, metadata)

    async def _lora_call(self, method, request, metadata: Metadata) -> None:
        """No deadline: an unload waits for the adapter's running requests."""
        try:
            await method(request, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            raise api_error(exc) from None
        finally:
            self._models.clear()  # the served adapters changed (or may have)

    async def detokenize(self, token_ids: Sequence[int], metadata: Metadata = ()) -> str:
        request = generate_pb2.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=False)
        try:
            reply = await self.stub.Detokenize(request, timeout=UNARY_TIMEOUT_S, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            raise api_error(exc) from None
        return reply.text

    async def tokenize(
        self, request: generate_pb2.TokenizeRequest, metadata: Metadata = ()
    ) -> generate_pb2.TokenizeResponse:
        try:
            return await self.stub.Tokenize(request, timeout=UNARY_TIMEOUT_S, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            raise api_error(exc) from None

    async def first_token(self, prompt: str | Sequence[int], metadata: Metadata = ()):
        """A prompt's first token as (id, text), its text written as logprob tokens are
        (the token alone, decoded with special tokens kept); a text prompt is tokenized as
        Generate tokenizes it."""
        if isinstance(prompt, str):
            request = generate_pb2.TokenizeRequest(text=prompt)
            prompt = (await self.tokenize(request, metadata)).token_ids
        if not prompt:
            raise ApiError("prompt: echo with logprobs needs at least one prompt token", 400)
        return int(prompt[0]), await self.detokenize([prompt[0]], metadata)

    async def serving(self) -> bool:
        try:
            reply = await self.health.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def generate(
        self, requests: Sequence[generate_pb2.GenerateRequest], metadata: Metadata = ()
    ) -> GenerateStreams:
        return GenerateStreams(self.stub, requests, metadata)
