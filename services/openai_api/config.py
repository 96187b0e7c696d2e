"""Settings of the OpenAI-compatible HTTP front (`python -m services.openai_api --help`)."""

from __future__ import annotations

from dataclasses import dataclass

from common.config import (
    ServiceConfig,
    host_setting,
    log_level_setting,
    parse_size,
    port_setting,
    setting,
)


@dataclass(frozen=True)
class OpenAIApiConfig(ServiceConfig):
    """The Tandem OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions,
    /v1/models), a translation to the gateway's gRPC API. HTTPS, client certificates and
    TLS to the gateway follow TANDEM_TLS_* (docs/security.md); the client's Authorization
    header is passed on to the gateway."""

    host: str = host_setting("TANDEM_HTTP_HOST", "listen address of the HTTP API")
    port: int = port_setting(
        8000, "TANDEM_HTTP_PORT", "listen port of the HTTP API (0 = any free port)"
    )
    gateway: str = setting(
        "127.0.0.1:50051", "gateway address host:port", env="TANDEM_HTTP_GATEWAY"
    )
    max_body_size: str = setting(
        "8MiB", "largest accepted request body (larger: 413)", env="TANDEM_HTTP_MAX_BODY_SIZE"
    )
    log_level: str = log_level_setting()

    def __post_init__(self) -> None:
        self._check_service()
        self._address("gateway", self.gateway)
        self._require(self._size("max_body_size") >= 1, "max_body_size", "must be at least 1 byte")

    @property
    def max_body_bytes(self) -> int:
        return parse_size(self.max_body_size)
