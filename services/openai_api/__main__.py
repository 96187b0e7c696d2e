"""`python -m services.openai_api`: the OpenAI-compatible HTTP front of a running gateway."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import uvicorn

from common.grpc_server import insecure_channel
from common.lifecycle import StartupError, run_service, wait_for_shutdown_signal
from common.log import get_logger, setup_logging
from services.openai_api.app import create_app
from services.openai_api.config import OpenAIApiConfig
from services.openai_api.gateway_client import GatewayClient

log = get_logger("services.openai_api")


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: `wait_for_shutdown_signal` owns the signals,
    as in every other Tandem service."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def listen(host: str, port: int) -> socket.socket:
    """Bind before serving, so a port in use is a clear startup error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise StartupError(f"could not listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def serve(config: OpenAIApiConfig) -> None:
    setup_logging("openai_api", config.log_level)
    sock = listen(config.host, config.port)
    channel = insecure_channel(config.gateway)
    app = create_app(GatewayClient(channel), config.max_body_bytes)
    server = _Server(
        uvicorn.Config(app, log_config=None, access_log=False, lifespan="off", http="h11")
    )
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    shutdown = asyncio.create_task(wait_for_shutdown_signal())
    try:
        log.info(
            "listening", address=f"{config.host}:{sock.getsockname()[1]}", gateway=config.gateway
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
    run_service(OpenAIApiConfig, serve, prog="python -m services.openai_api")


if __name__ == "__main__":
    main()
