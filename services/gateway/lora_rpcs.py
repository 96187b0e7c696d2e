"""GenerateService's LoRA adapter calls: LoadLoraAdapter and UnloadLoraAdapter (only with
--allow-runtime-lora-updating, as vLLM guards its endpoints with
VLLM_ALLOW_RUNTIME_LORA_UPDATING: they read folders on the workers' hosts) and
ListLoraAdapters. Fields are checked here; the scheduler carries the change out on every
worker. A mixin of `GenerateServicer` (it uses the servicer's scheduler stub, `_ready` and
cached model description, which it refreshes after each change)."""

from __future__ import annotations

import grpc

from common.log import get_logger
from common.pb.tandem.internal.v1 import scheduler_pb2
from common.pb.tandem.v1 import generate_pb2
from services.gateway.validation import InvalidArgumentError

log = get_logger(__name__)
MAX_LORA_NAME_CHARS = 128
MAX_LORA_PATH_CHARS = 4096
MODEL_INFO_TIMEOUT_S = 10.0


def validate_lora_load(
    request: generate_pb2.LoadLoraAdapterRequest, model_names: tuple[str, ...]
) -> None:
    name, path = request.lora_name, request.lora_path
    if not 1 <= len(name) <= MAX_LORA_NAME_CHARS:
        raise InvalidArgumentError(
            f"lora_name must be 1..{MAX_LORA_NAME_CHARS} characters, got {len(name)}"
        )
    if not name.isprintable() or name != name.strip():
        raise InvalidArgumentError(
            "lora_name must be printable, without leading or trailing spaces"
        )
    if name in model_names:
        raise InvalidArgumentError(f"lora_name {name!r} is the base model's name")
    if not 1 <= len(path) <= MAX_LORA_PATH_CHARS:
        raise InvalidArgumentError(
            f"lora_path must be 1..{MAX_LORA_PATH_CHARS} characters, got {len(path)}"
        )
    if "\0" in path:
        raise InvalidArgumentError("lora_path must not contain NUL")


def adapter_info(adapter) -> generate_pb2.LoraAdapterInfo:
    return generate_pb2.LoraAdapterInfo(
        lora_name=adapter.name, lora_path=adapter.path, source=adapter.source
    )


class LoraRpcs:
    allow_runtime_lora_updating = False
    served_model_names: tuple[str, ...] = ()  # --served-model-name (empty: the folder's name)

    async def refresh_model(self) -> None:
        """Take the scheduler's current adapters (another gateway may have changed them)."""
        reply = await self.scheduler.GetModelInfo(
            scheduler_pb2.GetModelInfoRequest(), timeout=MODEL_INFO_TIMEOUT_S
        )
        self.model = reply.model

    async def _check_updating_allowed(self, context) -> None:
        if not self.allow_runtime_lora_updating:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "loading and unloading LoRA adapters at run time is off: start the gateway "
                "with --allow-runtime-lora-updating (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)",
            )

    async def LoadLoraAdapter(self, request, context):
        model = await self._ready(context)
        await self._check_updating_allowed(context)
        try:
            validate_lora_load(request, self.served_model_names or (model.name,))
        except InvalidArgumentError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            reply = await self.scheduler.LoadLoraAdapter(
                scheduler_pb2.LoadLoraAdapterRequest(
                    lora_name=request.lora_name, lora_path=request.lora_path
                ),
                timeout=context.time_remaining(),
            )
        except grpc.aio.AioRpcError as exc:
            log.info("lora_load_failed", lora_name=request.lora_name, error=exc.details())
            await context.abort(exc.code(), exc.details() or "scheduler error")
        await self.refresh_model()
        log.info("lora_loaded", lora_name=request.lora_name, lora_path=request.lora_path)
        return generate_pb2.LoadLoraAdapterResponse(adapter=adapter_info(reply.adapter))

    async def UnloadLoraAdapter(self, request, context):
        await self._ready(context)
        await self._check_updating_allowed(context)
        try:
            await self.scheduler.UnloadLoraAdapter(
                scheduler_pb2.UnloadLoraAdapterRequest(lora_name=request.lora_name),
                timeout=context.time_remaining(),
            )
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details() or "scheduler error")
        await self.refresh_model()
        log.info("lora_unloaded", lora_name=request.lora_name)
        return generate_pb2.UnloadLoraAdapterResponse()

    async def ListLoraAdapters(self, request, context):
        await self._ready(context)
        try:
            reply = await self.scheduler.ListLoraAdapters(
                scheduler_pb2.ListLoraAdaptersRequest(), timeout=context.time_remaining() or 10.0
            )
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details() or "scheduler error")
        return generate_pb2.ListLoraAdaptersResponse(
            adapters=[adapter_info(a) for a in reply.adapters]
        )
