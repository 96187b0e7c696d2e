"""`python -m services.openai_api`: the OpenAI-compatible HTTP front of a running gateway.

Under the `TANDEM_TLS_*` environment (`common/tls.py`) it serves HTTPS with the same
certificate and key as the gRPC services (requiring client certificates under
`TANDEM_TLS_CLIENT_AUTH`) and reaches the gateway over TLS."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from typing import Any

import uvicorn

from common.grpc_server import MAX_METADATA_BYTES, open_channel
from common.lifecycle import (
    StartupError,
    freeze_startup_heap,
    run_service,
    wait_for_shutdown_signal,
)
from common.log import get_logger, setup_logging
from common.tls import TlsSettings, tls_from_env
from services.openai_api.app import create_app
from services.openai_api.config import OpenAIApiConfig
from services.openai_api.connection_limits import bounded_h11_protocol
from services.openai_api.gateway_client import GatewayClient
from services.openai_api.response_store import ResponseStore

log = get_logger("services.openai_api")
# Seconds a shutdown waits for open connections (as the gateway's grace): an idle HTTPS
# keep-alive client that never answers the TLS close would otherwise hold it up.
SHUTDOWN_GRACE_S = 5.0


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: `wait_for_shutdown_signal` owns the signals,
    as in every other Tandem service."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def listen(host: str, port: int) -> socket.socket:
    """Bind before serving, so a port in use is a clear startup error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on
    # sockets whose protocol says TCP; with proto 0 every SSE chunk waited for the
    # client's delayed ACK (up to 40 ms on the first token).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise StartupError(f"could not listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def https_options(tls: TlsSettings) -> dict[str, Any]:
    """uvicorn's ssl settings: none for plaintext, else this process's certificate and,
    under client auth, a required client certificate signed by the CA."""
    if not tls.enabled:
        return {}
    if not tls.can_serve:
        raise ValueError(
            "TLS is on (TANDEM_TLS_CA is set) but TANDEM_TLS_CERT/TANDEM_TLS_KEY are not: "
            "the HTTPS front needs its own certificate and key"
        )
    options: dict[str, Any] = {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file}
    if tls.client_auth:
        options.update(ssl_ca_certs=tls.ca_file, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options


async def serve(config: OpenAIApiConfig) -> None:
    setup_logging("openai_api", config.log_level)
    tls = tls_from_env()
    ssl_options = https_options(tls)
    sock = listen(config.host, config.port)
    channel = open_channel(config.gateway, tls)
    app = create_app(
        GatewayClient(channel, config.served_model_name),
        config.max_body_bytes,
        ResponseStore(config.response_store_bytes, config.response_store_ttl_s),
    )
    app.state.body_timeout_s = config.body_timeout_s
    server = _Server(
        uvicorn.Config(
            app,
            log_config=None,
            access_log=False,
            lifespan="off",
            http=bounded_h11_protocol(config.header_timeout_s, config.max_connections),
            # h11's own limit (16 KiB by default) stays above ours, which answers 431.
            h11_max_incomplete_event_size=2 * MAX_METADATA_BYTES,
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
            **ssl_options,
        )
    )
    freeze_startup_heap()
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    shutdown = asyncio.create_task(wait_for_shutdown_signal())
    try:
        log.info(
            "listening",
            address=f"{config.host}:{sock.getsockname()[1]}",
            scheme="https" if ssl_options else "http",
            client_certificates=tls.client_auth,
            gateway=config.gateway,
        )
        await asyncio.wait({serving, shutdown}, return_when=asyncio.FIRST_COMPLETED)
        if shutdown.done():
            log.info("shutting_down", signal=shutdown.result())
        server.should_exit = True
        await serving
    finally:
        shutdown.cancel()
        await channel.close()
        sock.close()


def main() -> None:
    run_service(
        OpenAIApiConfig,
        serve,
        prog="python -m services.openai_api",
        trace_name=lambda _: "tandem-http",
    )


if __name__ == "__main__":
    main()
