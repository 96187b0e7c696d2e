"""Run-time LoRA loads and unloads across the workers (the scheduler's LoadLoraAdapter /
UnloadLoraAdapter), and bringing a rejoining worker's adapters in line.

A load asks every worker to read the folder; it is served only when all the healthy ones
hold it, and undone on those that do when one refuses (all or none). A failed worker that
missed it gets it when it rejoins, before its first step. An unload stops new requests at
once, waits for the requests already on the adapter (queued, running or preempted) to
finish, then has every worker drop it."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable

from common.log import get_logger
from services.scheduler.lora_registry import LoraEntry, LoraRegistry
from services.scheduler.pool import Pool
from services.scheduler.worker_types import (
    LoraRefusedError,
    WorkerConnection,
    WorkerInfo,
    WorkerUnavailableError,
)

log = get_logger(__name__)
LORA_CALL_TIMEOUT_S = 120.0  # reading a large adapter from a slow disk
DRAIN_POLL_S = 0.02


class LoraAdmin:
    def __init__(self, engine) -> None:
        """`engine`: its pools, its adapters (`loras`) and `requests_using(name)`."""
        self.engine = engine
        self.registry: LoraRegistry = engine.loras

    async def load(self, name: str, path: str) -> LoraEntry:
        """Serve `path` as `name` on every worker. Raises LoraConflictError (name taken),
        LoraRefusedError (a worker cannot apply it: the message says why) or
        WorkerUnavailableError (a healthy worker did not answer)."""
        entry = self.registry.begin_load(name, path)
        loaded = False
        try:
            pools = list(self.engine.pools)
            results = await asyncio.gather(
                *(p.client.add_lora(name, path, LORA_CALL_TIMEOUT_S) for p in pools),
                return_exceptions=True,
            )
            error = _first_error(pools, results)
            if error is not None:
                holding = [p for p, r in zip(pools, results, strict=True) if r is None]
                await self._remove(holding, name)
                raise error
            loaded = True
            log.info("lora_loaded", lora_name=name, lora_path=path, workers=len(pools))
            return entry
        finally:
            self.registry.finish_load(entry, loaded)

    async def unload(self, name: str) -> None:
        """Stop serving `name` (LoraNotFoundError if it is not served); returns once its
        requests have finished and the workers have dropped it."""
        self.registry.begin_unload(name)
        try:
            while self.engine.requests_using(name):
                await asyncio.sleep(DRAIN_POLL_S)
            await self._remove(self.engine.pools, name)
            log.info("lora_unloaded", lora_name=name)
        finally:
            self.registry.finish_unload(name)

    async def _remove(self, pools: Iterable[Pool], name: str) -> None:
        pools = list(pools)
        results = await asyncio.gather(
            *(p.client.remove_lora(name, LORA_CALL_TIMEOUT_S) for p in pools),
            return_exceptions=True,
        )
        for pool, result in zip(pools, results, strict=True):
            if isinstance(result, Exception):  # it keeps a copy no request can name
                log.warning("lora_remove_failed", lora_name=name, worker_id=pool.info.worker_id,
                            error=str(result))  # fmt: skip


def _first_error(pools: list[Pool], results: list) -> Exception | None:
    """What a load's answers make of it: the first refusal, else the first healthy worker
    that did not answer; None when every worker that counts holds the adapter."""
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, Exception):
            raise result  # cancelled
        if isinstance(result, LoraRefusedError):
            return result
    for pool, result in zip(pools, results, strict=True):
        if isinstance(result, WorkerUnavailableError) and pool.healthy:
            return result
        if isinstance(result, Exception) and not isinstance(result, WorkerUnavailableError):
            return result
    return None


async def sync_worker(
    client: WorkerConnection, info: WorkerInfo, registry: LoraRegistry
) -> WorkerInfo:
    """A worker that (re)joins holds exactly the served adapters: those loaded at run time
    are added, those it loaded at start but that were unloaded since are removed."""
    served = {entry.name: entry for entry in registry.entries}
    held = set(info.model.lora_adapters)
    for entry in served.values():
        if entry.path:  # a run-time load: the folder is known
            await client.add_lora(entry.name, entry.path, LORA_CALL_TIMEOUT_S)
        elif entry.name not in held:
            raise ValueError(f"worker at {info.address} came back without LoRA adapter "
                             f"{entry.name!r} (--lora-modules)")  # fmt: skip
    for name in held - set(served):
        await client.remove_lora(name, LORA_CALL_TIMEOUT_S)
    model = dataclasses.replace(info.model, lora_adapters=registry.names)
    return dataclasses.replace(info, model=model)
