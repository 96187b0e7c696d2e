"""The grpc.aio server every Tandem service runs: its servicers plus health and reflection.

Health is the standard `grpc.health.v1.Health` (so probes and `grpcurl` work); a service
reports SERVING only once it can actually serve. Every answer carries the process's boot
id (random per `ServiceHost`) as initial metadata (`BOOT_ID_METADATA`): a peer that sees
it change knows the service restarted, however quickly it came back. Reflection lists
every service. Requests that do not parse fail with INVALID_ARGUMENT
(`malformed_requests.py`). Ports and channels use TLS / mutual TLS when the `TANDEM_TLS_*`
environment asks for it (`tls.py`).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.keepalive import Keepalive
from common.malformed_requests import MalformedRequestInterceptor
from common.tls import TlsSettings, tls_from_env

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# A call's metadata (headers), credentials included (docs/security.md, "Oversized
# credentials"). One limit, both soft and hard: gRPC's defaults (8 KiB soft, 16 KiB hard)
# refuse calls between the two at random, so whether a 12 KiB token reached the key check
# was chance. Above it: RESOURCE_EXHAUSTED from the transport, before any key is looked at.
MAX_METADATA_BYTES = 64 * 1024

SERVER_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_metadata_size", MAX_METADATA_BYTES),
    ("grpc.absolute_max_metadata_size", MAX_METADATA_BYTES),
    # A port clash must fail loudly instead of silently sharing the port.
    ("grpc.so_reuseport", 0),
)

# Reconnect backoff: gRPC's default starts at 1 s and grows 1.6x to 120 s, so a peer that
# comes up (or back) while its caller keeps retrying was noticed seconds late: a scheduler
# polling workers that are still importing, a gateway whose scheduler was restarted. On a
# loopback or cluster network a retry every second at most costs nothing.
RECONNECT_INITIAL_BACKOFF_MS = 100
RECONNECT_MAX_BACKOFF_MS = 1000

CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", RECONNECT_INITIAL_BACKOFF_MS),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_BACKOFF_MS),
)


BOOT_ID_METADATA = "tandem-boot-id"


class _BootHealth(health.aio.HealthServicer):
    """grpc.health.v1 whose every Check answer names this process's boot id."""

    def __init__(self, boot_id: str) -> None:
        super().__init__()
        self.boot_id = boot_id

    async def Check(self, request, context):
        await context.send_initial_metadata(((BOOT_ID_METADATA, self.boot_id),))
        return await super().Check(request, context)


class ServiceHost:
    """A grpc.aio server with health and reflection for the named services.

    `interceptors` run after the malformed-request check; `tls` defaults to the
    process's `TANDEM_TLS_*` environment (read here, so a bad setting fails at startup);
    `max_receive_bytes` caps one request message."""

    def __init__(
        self,
        service_names: Sequence[str],
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        tls: TlsSettings | None = None,
        max_receive_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        self.tls = tls_from_env() if tls is None else tls
        # A larger request is refused by grpc with RESOURCE_EXHAUSTED before it is parsed.
        options = tuple(o for o in SERVER_OPTIONS if o[0] != "grpc.max_receive_message_length")
        options += (("grpc.max_receive_message_length", max_receive_bytes),)
        options += Keepalive.from_env().server_options()
        self.server = grpc.aio.server(
            options=options,
            interceptors=[MalformedRequestInterceptor(), *interceptors],
        )
        self.service_names = tuple(service_names)
        self.boot_id = uuid.uuid4().hex  # random per process (made after any fork)
        self.health = _BootHealth(self.boot_id)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server
        )

    def bind(self, host: str, port: int) -> int:
        """Listen on host:port (0 picks a free port), with TLS when configured; returns the
        bound port."""
        address = f"{host}:{port}"
        if self.tls.enabled:
            bound = self.server.add_secure_port(address, self.tls.server_credentials())
        else:
            bound = self.server.add_insecure_port(address)
        if bound == 0:
            raise OSError(f"could not listen on {host}:{port} (in use?)")
        return bound

    async def start(self) -> None:
        await self.set_serving(False)
        await self.server.start()

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace: float | None = 5.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)

    def _tls_mode(self) -> str:
        if not self.tls.enabled:
            return "off"
        return "mutual" if self.tls.client_auth else "on"

    @asynccontextmanager
    async def running(self, host: str, port: int, log, grace: float = 5.0) -> AsyncIterator[int]:
        """Listen (health NOT_SERVING until the caller says otherwise) and always stop on
        exit, also when startup fails; yields the bound port."""
        bound = self.bind(host, port)
        await self.start()
        log.info("listening", address=f"{host}:{bound}", tls=self._tls_mode())
        try:
            yield bound
        finally:
            await self.stop(grace)


def open_channel(address: str, tls: TlsSettings | None = None) -> grpc.aio.Channel:
    """A grpc.aio channel to a Tandem service: TLS per `tls` (default: the environment)."""
    tls = tls_from_env() if tls is None else tls
    options = CHANNEL_OPTIONS + Keepalive.from_env().channel_options()
    if not tls.enabled:
        return grpc.aio.insecure_channel(address, options=options)
    options += tls.channel_options()
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)


def open_sync_channel(address: str, tls: TlsSettings | None = None) -> grpc.Channel:
    """`open_channel` for blocking clients (CLI, probes, tests, benchmarks)."""
    tls = tls_from_env() if tls is None else tls
    options = CHANNEL_OPTIONS + Keepalive.from_env().channel_options()
    if not tls.enabled:
        return grpc.insecure_channel(address, options=options)
    options += tls.channel_options()
    return grpc.secure_channel(address, tls.channel_credentials(), options=options)
