"""The schedulers a gateway fronts (`--scheduler a:1,b:2`): per scheduler a channel, a
`SchedulerSession`, its health and its model; which one takes a request.

With one scheduler everything is today's path: it takes every request, no prompt is
hashed, and the gateway's health mirrors that scheduler's. With several, each has its own
session (and its own reconnects) and health watcher; a request goes where
`scheduler_router.py` says among the healthy ones that serve its adapter, and the gateway
is SERVING while any scheduler is; the router follows each scheduler's KV events
(`kv_follower.py`, one task per scheduler from `start`). A scheduler whose session breaks is
taken out at once
(its requests fail there, see `server.py` for the retry) and comes back when its health
says SERVING again and it still serves the same model with the same block size (a
different model keeps it out). Every scheduler must answer `GetModelInfo` at start and
serve the same model, or the gateway refuses to start.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from common.grpc_server import open_channel
from common.healthcheck import channel_health_status
from common.lifecycle import StartupError
from common.log import get_logger
from common.pb.tandem.internal.v1 import scheduler_pb2, scheduler_pb2_grpc, types_pb2
from common.tls import TlsSettings
from services.gateway.kv_follower import KvEventsFollower
from services.gateway.metrics import watch_scheduler
from services.gateway.scheduler_router import RouterConfig, SchedulerRouter, prompt_block_hashes
from services.gateway.scheduler_session import SchedulerError, SchedulerSession

log = get_logger(__name__)
MODEL_INFO_TIMEOUT_S = 10.0


def answers(replies: list[tuple[Backend, object]]) -> list:
    """The replies of `Schedulers.call_all` that are not errors."""
    return [r for _, r in replies if not isinstance(r, grpc.aio.AioRpcError)]


def failures(replies: list[tuple[Backend, object]]) -> list[grpc.aio.AioRpcError]:
    return [r for _, r in replies if isinstance(r, grpc.aio.AioRpcError)]


async def abort_with(context, error: grpc.aio.AioRpcError | None) -> None:
    """End the call with a scheduler's error (None: no scheduler could be asked)."""
    if error is None:
        await context.abort(grpc.StatusCode.UNAVAILABLE, "no scheduler available")
    await context.abort(error.code(), error.details() or "scheduler error")


def model_identity(model: types_pb2.ModelDescription, block_size: int) -> tuple:
    """What must be equal across schedulers (adapters may differ while one loads)."""
    return (
        model.name,
        model.architecture,
        model.vocab_size,
        model.max_model_len,
        tuple(model.eos_token_ids),
        model.dtype,
        model.num_layers,
        model.num_kv_heads,
        model.head_dim,
        block_size,
    )


@dataclass(eq=False)
class Backend:
    """One scheduler as the gateway sees it."""

    address: str
    channel: grpc.aio.Channel
    stub: scheduler_pb2_grpc.SchedulerServiceStub
    session: SchedulerSession = field(init=False)
    healthy: bool = True
    model: types_pb2.ModelDescription | None = None
    block_size: int = 0

    async def fetch_model(self) -> tuple[types_pb2.ModelDescription, int]:
        reply = await self.stub.GetModelInfo(
            scheduler_pb2.GetModelInfoRequest(), timeout=MODEL_INFO_TIMEOUT_S
        )
        return reply.model, reply.kv_block_size


class Schedulers:
    def __init__(
        self, addresses: tuple[str, ...], tls: TlsSettings | None, router: RouterConfig
    ) -> None:
        self.backends: list[Backend] = []
        for address in addresses:
            channel = open_channel(address, tls)
            backend = Backend(address, channel, scheduler_pb2_grpc.SchedulerServiceStub(channel))
            backend.session = SchedulerSession(
                backend.stub, lambda error, b=backend: self._broken(b, error), address
            )
            watch_scheduler(address, lambda s=backend.session: s.num_open)
            self.backends.append(backend)
        self.router = SchedulerRouter(router) if len(self.backends) > 1 else None
        self._identity: tuple | None = None
        self.followers = (
            [
                KvEventsFollower(b.address, b.stub, self.router, router.kv_events_retry_s)
                for b in self.backends
            ]
            if self.router is not None and router.kv_events
            else []
        )
        self._following: list[asyncio.Task] = []

    def start(self) -> None:
        """Follow every scheduler's KV events (several schedulers; once their models
        are known)."""
        self._following = [asyncio.ensure_future(f.run()) for f in self.followers]

    @property
    def single(self) -> bool:
        return self.router is None

    @property
    def num_open(self) -> int:
        return sum(b.session.num_open for b in self.backends)

    def healthy(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    # Models.

    async def wait_models(self, timeout_s: float) -> types_pb2.ModelDescription:
        """Ask every scheduler for its model until all answer (they wait for their
        workers); they must agree. Returns the model as the gateway serves it."""
        await asyncio.gather(*(self._wait_model(b, timeout_s) for b in self.backends))
        identities = {b.address: model_identity(b.model, b.block_size) for b in self.backends}
        if len(set(identities.values())) > 1:
            raise StartupError(f"the schedulers serve different models: {identities}")
        self._identity = next(iter(identities.values()))
        return self.model()

    async def _wait_model(self, backend: Backend, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                backend.model, backend.block_size = await backend.fetch_model()
                return
            except grpc.aio.AioRpcError as exc:
                if time.monotonic() > deadline:
                    raise StartupError(
                        f"scheduler {backend.address} not ready after {timeout_s:.0f}s: "
                        f"{exc.code().name} {exc.details()}"
                    ) from exc
                await asyncio.sleep(0.25)

    def model(self) -> types_pb2.ModelDescription:
        """The served model: the first scheduler's, with every healthy scheduler's
        adapters (a request names one; it goes to a scheduler that has it)."""
        model = types_pb2.ModelDescription()
        model.CopyFrom(self.backends[0].model)
        names: list[str] = []
        for backend in self.backends if self.single else self.healthy():
            names += [n for n in backend.model.lora_adapters if n not in names]
        del model.lora_adapters[:]
        model.lora_adapters.extend(names)
        return model

    async def refresh_models(self) -> types_pb2.ModelDescription:
        """Take each scheduler's current adapters (changed here or by another gateway);
        raises the first scheduler's error when none answered."""
        targets = self.backends if self.single else self.healthy()
        results = await asyncio.gather(*(b.fetch_model() for b in targets), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        for backend, result in zip(targets, results, strict=True):
            if not isinstance(result, BaseException):
                backend.model = result[0]
        if errors and len(errors) == len(results):
            raise errors[0]
        return self.model()

    # Routing.

    def pick(
        self, submit: scheduler_pb2.SubmitRequest, exclude: tuple[Backend, ...] = ()
    ) -> Backend | None:
        """The scheduler for this request (None: none can take it). One scheduler: always
        it, on the first try."""
        if self.single:
            return None if exclude else self.backends[0]
        candidates = {
            b.address: b
            for b in self.healthy()
            if b not in exclude
            and (not submit.lora_name or submit.lora_name in b.model.lora_adapters)
        }
        hashes = prompt_block_hashes(
            submit.prompt_token_ids,
            self.backends[0].block_size,
            submit.cache_salt,
            submit.lora_name,
        )
        route = self.router.choose(
            hashes,
            {address: b.session.num_open for address, b in candidates.items()},
            submit.request_id,
        )
        if route is None:
            return None
        log.debug(
            "routed",
            scheduler=route.scheduler,
            overlap_blocks=route.overlap_blocks,
            overridden=route.overridden,
            from_events=route.from_events,
        )
        return candidates[route.scheduler]

    def finished(self, request_id: str) -> None:
        """The request picked for (by `pick`) is over, wherever it ran."""
        if self.router is not None:
            self.router.finished(request_id)

    # Fan-out calls.

    async def call_all(
        self, call: Callable[[Backend], Awaitable], targets: list[Backend] | None = None
    ) -> list[tuple[Backend, object]]:
        """`call(backend)` on every healthy scheduler (one scheduler: on it, whatever its
        health), concurrently: (backend, result or the AioRpcError) pairs."""
        if targets is None:
            targets = self.backends if self.single else self.healthy()
        results = await asyncio.gather(*(call(b) for b in targets), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, grpc.aio.AioRpcError):
                raise result
        return list(zip(targets, results, strict=True))

    # Health.

    def _broken(self, backend: Backend, error: SchedulerError) -> None:
        if self.single or error.code != grpc.StatusCode.UNAVAILABLE:
            return
        self._set_healthy(backend, False)

    def _set_healthy(self, backend: Backend, healthy: bool) -> None:
        if backend.healthy == healthy:
            return
        backend.healthy = healthy
        if not healthy and self.router is not None:
            self.router.forget(backend.address)  # its cache is gone or unknown
        log.warning(
            "scheduler_serving" if healthy else "scheduler_not_serving", scheduler=backend.address
        )

    async def watch_health(self, set_serving: Callable[[bool], Awaitable], interval_s: float):
        """Probe every scheduler's health every `interval_s`; the gateway serves while any
        one does (one scheduler: the gateway's health mirrors it, as before)."""
        serving = True
        while True:
            await asyncio.sleep(interval_s)
            await asyncio.gather(*(self._probe(b, interval_s) for b in self.backends))
            ok = any(b.healthy for b in self.backends)
            if ok != serving:
                serving = ok
                await set_serving(ok)

    async def _probe(self, backend: Backend, interval_s: float) -> None:
        ok = await channel_health_status(backend.channel, timeout_s=interval_s * 2) == "SERVING"
        if ok and not backend.healthy and not self.single:
            try:  # back: is it (still) the same model?
                model, block_size = await backend.fetch_model()
            except grpc.aio.AioRpcError:
                return
            if model_identity(model, block_size) != self._identity:
                log.error("scheduler_model_mismatch", scheduler=backend.address, model=model.name)
                return
            backend.model = model
        self._set_healthy(backend, ok)

    async def close(self) -> None:
        for task in self._following:
            task.cancel()
        await asyncio.gather(*self._following, return_exceptions=True)
        for backend in self.backends:
            await backend.session.close()
            await backend.channel.close()
