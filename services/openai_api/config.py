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
    /v1/responses, Anthropic's /v1/messages, /v1/models), a translation to the gateway's
    gRPC API. HTTPS, client certificates and
    TLS to the gateway follow TANDEM_TLS_* (docs/security.md); the client's Authorization
    header is passed on to the gateway."""

    host: str = host_setting("TANDEM_HTTP_HOST", "listen address of the HTTP API")
    port: int = port_setting(
        8000, "TANDEM_HTTP_PORT", "listen port of the HTTP API (0 = any free port)"
    )
    gateway: str = setting(
        "127.0.0.1:50051", "gateway address host:port", env="TANDEM_HTTP_GATEWAY"
    )
    served_model_name: tuple[str, ...] = setting(
        (),
        "the name(s) this front lists and accepts for the gateway's model (vLLM's "
        "--served-model-name, one or more); default: the names the gateway lists (its own "
        "--served-model-name, or the model folder's name)",
        env="TANDEM_SERVED_MODEL_NAME",
    )
    max_body_size: str = setting(
        "8MiB", "largest accepted request body (larger: 413)", env="TANDEM_HTTP_MAX_BODY_SIZE"
    )
    header_timeout_s: float = setting(
        30.0,
        "seconds a connection has to send a request's headers (from opening, or from the "
        "previous response); then it gets 408 and is closed",
        env="TANDEM_HTTP_HEADER_TIMEOUT_S",
    )
    body_timeout_s: float = setting(
        60.0,
        "seconds a request has to send its whole body once its headers are in (then 408)",
        env="TANDEM_HTTP_BODY_TIMEOUT_S",
    )
    max_connections: int = setting(
        1024,
        "most open client connections; past it new ones are closed on accept",
        env="TANDEM_HTTP_MAX_CONNECTIONS",
    )
    response_store_size: str = setting(
        "256MiB",
        "memory the Responses API's store may hold (responses created with store=true, "
        "for GET/DELETE /v1/responses/{id} and previous_response_id; past it the least "
        "recently used go first; 0 = store nothing)",
        env="TANDEM_RESPONSE_STORE_SIZE",
    )
    response_store_ttl_s: float = setting(
        3600.0,
        "seconds a stored response is kept (then: 404, as an unknown id)",
        env="TANDEM_RESPONSE_STORE_TTL_S",
    )
    log_level: str = log_level_setting()

    def __post_init__(self) -> None:
        self._check_service()
        self._address("gateway", self.gateway)
        self._model_names("served_model_name")
        self._require(self._size("max_body_size") >= 1, "max_body_size", "must be at least 1 byte")
        self._positive("header_timeout_s", "body_timeout_s", "max_connections")
        self._size("response_store_size")
        self._positive("response_store_ttl_s")

    @property
    def max_body_bytes(self) -> int:
        return parse_size(self.max_body_size)

    @property
    def response_store_bytes(self) -> int:
        return parse_size(self.response_store_size)
