"""`python -m common.healthcheck [--http] HOST:PORT`: exit 0 if the service is SERVING —
its grpc.health.v1 status, or with --http the HTTP front's `GET /health` answering 200 (it
does only while the gateway is SERVING). Used by compose healthchecks, `make up` and
`make status`.

Both probes follow the `TANDEM_TLS_*` environment like the services do (`common/tls.py`):
TLS-checked against the CA, presenting this process's certificate under mutual TLS, and
HTTPS for the HTTP front. Health needs no API key.
"""

from __future__ import annotations

import http.client
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.grpc_server import BOOT_ID_METADATA, open_sync_channel
from common.tls import TlsSettings, tls_from_env


class _HTTPSConnection(http.client.HTTPSConnection):
    """HTTPS that checks the certificate against `server_name` instead of the host dialed
    (`TANDEM_TLS_SERVER_NAME`)."""

    def __init__(self, host: str, port: int, server_name: str, **kwargs) -> None:
        super().__init__(host, port, **kwargs)
        self._server_name = server_name

    def connect(self) -> None:
        http.client.HTTPConnection.connect(self)
        self.sock = self._context.wrap_socket(self.sock, server_hostname=self._server_name)


async def channel_health_status(channel: grpc.aio.Channel, timeout_s: float) -> str:
    """The status name behind an open grpc.aio channel, or 'UNREACHABLE' (down, hung, or
    no answer within timeout_s). Services probe their peers with it."""
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
        )
    except grpc.aio.AioRpcError:
        return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


async def channel_health(channel: grpc.aio.Channel, timeout_s: float) -> tuple[str, str]:
    """(status name, the service's boot id) behind an open channel: 'UNREACHABLE' as in
    `channel_health_status`; the boot id is '' when the service sends none."""
    try:
        call = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
        )
        reply = await call
        metadata = await call.initial_metadata()
    except grpc.aio.AioRpcError:
        return "UNREACHABLE", ""
    boot_id = next((str(v) for k, v in metadata or () if k == BOOT_ID_METADATA), "")
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status), boot_id


def health_status(address: str, timeout_s: float = 1.0, tls: TlsSettings | None = None) -> str:
    """'SERVING', 'NOT_SERVING', ... or 'UNREACHABLE' (also when TLS fails). `tls`
    defaults to the environment's."""
    try:
        with open_sync_channel(address, tls) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
            )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError:
        return "UNREACHABLE"


def _connection(address: str, timeout_s: float, tls: TlsSettings) -> http.client.HTTPConnection:
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if not tls.enabled:
        return http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    context = tls.client_ssl_context()
    return _HTTPSConnection(
        host, int(port), tls.server_name or host, timeout=timeout_s, context=context
    )


def http_health_status(address: str, timeout_s: float = 1.0, tls: TlsSettings | None = None) -> str:
    """'SERVING' (200), 'NOT_SERVING' (another status) or 'UNREACHABLE' (also when TLS
    fails). HTTPS when TLS is configured; `tls` defaults to the environment's."""
    tls = tls_from_env() if tls is None else tls
    try:
        # Direct connection: a loopback probe must not go through a proxy from the env.
        connection = _connection(address, timeout_s, tls)
        try:
            connection.request("GET", "/health")
            status = connection.getresponse().status
        finally:
            connection.close()
    except (OSError, ValueError, http.client.HTTPException):
        return "UNREACHABLE"
    return "SERVING" if status == 200 else "NOT_SERVING"


def main(argv: list[str]) -> int:
    http = argv[:1] == ["--http"]
    if http:
        argv = argv[1:]
    if len(argv) != 1:
        print("usage: python -m common.healthcheck [--http] HOST:PORT", file=sys.stderr)
        return 2
    try:
        tls = tls_from_env()
    except ValueError as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        return 2
    status = (http_health_status if http else health_status)(argv[0], timeout_s=3.0, tls=tls)
    print(status)
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
