"""GenerateService's LoRA adapter calls: LoadLoraAdapter and UnloadLoraAdapter (only with
--allow-runtime-lora-updating, as vLLM guards its endpoints with
VLLM_ALLOW_RUNTIME_LORA_UPDATING: they read folders on the workers' hosts) and
ListLoraAdapters. Fields are checked here; the scheduler carries the change out on every
worker. With several schedulers a load or unload goes to every healthy one (a load that
fails on one is undone on the others) and the list is their union. A mixin of
`GenerateServicer` (it uses the servicer's `schedulers`, `_ready` and cached model
description, which it refreshes after each change)."""

from __future__ import annotations

import grpc

from common.log import get_logger
from common.pb.tandem.internal.v1 import scheduler_pb2
from common.pb.tandem.v1 import generate_pb2
from services.gateway.schedulers import abort_with, answers, failures
from services.gateway.validation import InvalidArgumentError

log = get_logger(__name__)
MAX_LORA_NAME_CHARS = 128
MAX_LORA_PATH_CHARS = 4096


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


class LoraRpcs:
    allow_runtime_lora_updating = False
    served_model_names: tuple[str, ...] = ()  # --served-model-name (empty: the folder's name)

    async def refresh_model(self) -> None:
        """Take the schedulers' current adapters (another gateway may have changed them)."""
        self.model = await self.schedulers.refresh_models()

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
        load = scheduler_pb2.LoadLoraAdapterRequest(
            lora_name=request.lora_name, lora_path=request.lora_path
        )
        timeout = context.time_remaining()
        replies = await self.schedulers.call_all(
            lambda b: b.stub.LoadLoraAdapter(load, timeout=timeout)
        )
        errors = failures(replies)
        if errors or not replies:
            loaded = [b for b, r in replies if not isinstance(r, grpc.aio.AioRpcError)]
            if loaded:
                await self._unload(loaded, request.lora_name, timeout)  # all or none
            exc = errors[0] if errors else None
            log.info("lora_load_failed", lora_name=request.lora_name, error=str(exc))
            await abort_with(context, exc)
        reply = replies[0][1]
        await self.refresh_model()
        log.info("lora_loaded", lora_name=request.lora_name, lora_path=request.lora_path)
        return generate_pb2.LoadLoraAdapterResponse(adapter=reply.adapter)

    async def UnloadLoraAdapter(self, request, context):
        await self._ready(context)
        await self._check_updating_allowed(context)
        replies = await self._unload(None, request.lora_name, context.time_remaining())
        errors = failures(replies)
        # NOT_FOUND on some schedulers is fine when others had it (a failed load's leftovers).
        serious = [e for e in errors if e.code() != grpc.StatusCode.NOT_FOUND]
        if serious or len(errors) == len(replies):
            await abort_with(context, (serious or errors or [None])[0])
        await self.refresh_model()
        log.info("lora_unloaded", lora_name=request.lora_name)
        return generate_pb2.UnloadLoraAdapterResponse()

    async def _unload(self, targets, lora_name: str, timeout: float | None):
        unload = scheduler_pb2.UnloadLoraAdapterRequest(lora_name=lora_name)
        return await self.schedulers.call_all(
            lambda b: b.stub.UnloadLoraAdapter(unload, timeout=timeout), targets
        )

    async def ListLoraAdapters(self, request, context):
        await self._ready(context)
        timeout = context.time_remaining() or 10.0
        replies = await self.schedulers.call_all(
            lambda b: b.stub.ListLoraAdapters(
                scheduler_pb2.ListLoraAdaptersRequest(), timeout=timeout
            )
        )
        answered = answers(replies)
        if not answered:
            await abort_with(context, replies[0][1] if replies else None)
        adapters = {}
        for reply in answered:
            for adapter in reply.adapters:
                adapters.setdefault(adapter.lora_name, adapter)
        return generate_pb2.ListLoraAdaptersResponse(adapters=list(adapters.values()))
