"""Settings of the OpenAI-compatible HTTP front (`python -m services.openai_api --help`)."""

from __future__ import annotations

from dataclasses import dataclass

from common.config import check_port, parse_address, parse_size, setting


@dataclass(frozen=True)
class OpenAIApiConfig:
    """The Tandem OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions,
    /v1/models), a translation to the gateway's gRPC API. HTTPS, client certificates and
    TLS to the gateway follow TANDEM_TLS_* (docs/security.md); the client's Authorization
    header is passed on to the gateway."""

    host: str = setting("127.0.0.1", "listen address of the HTTP API", env="TANDEM_HTTP_HOST")
    port: int = setting(
        8000, "listen port of the HTTP API (0 = any free port)", env="TANDEM_HTTP_PORT"
    )
    gateway: str = setting(
        "127.0.0.1:50051", "gateway address host:port", env="TANDEM_HTTP_GATEWAY"
    )
    max_body_size: str = setting(
        "8MiB", "largest accepted request body (larger: 413)", env="TANDEM_HTTP_MAX_BODY_SIZE"
    )
    log_level: str = setting("info", "debug, info, warning or error", env="TANDEM_LOG_LEVEL")

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host must not be empty")
        check_port(self.port, "port")
        parse_address(self.gateway, "gateway")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_size must be at least 1 byte, got {self.max_body_size!r}")

    @property
    def max_body_bytes(self) -> int:
        return parse_size(self.max_body_size)
