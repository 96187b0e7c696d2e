"""Settings of the gateway process (`python -m services.gateway --help`)."""

from __future__ import annotations

from dataclasses import dataclass

from common.config import check_port, parse_address, parse_size, setting


def _secret_setting(help: str, env: str):
    """A `setting` kept out of the config's repr (tracebacks, logs)."""
    field = setting("", help, env=env)
    field.repr = False
    return field


def read_key_file(path: str) -> str:
    """The API key in `path` (surrounding whitespace dropped)."""
    try:
        with open(path, encoding="utf-8") as file:
            key = file.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"api_key_file: cannot read {path!r}: {exc}") from None
    if not key:
        raise ValueError(f"api_key_file: {path!r} is empty")
    return key


def _check_key(key: str, what: str) -> None:
    # The key travels as a gRPC metadata / HTTP header value: printable ASCII only.
    if not key.isascii() or not key.isprintable() or key != key.strip() or " " in key:
        raise ValueError(f"{what} must be printable ASCII without spaces")


@dataclass(frozen=True)
class GatewayConfig:
    """The Tandem gateway: public Generate API, validation, tokenization, detokenization.
    TLS follows TANDEM_TLS_* (docs/security.md)."""

    model: str = setting("", "model folder whose tokenizer the gateway uses", env="TANDEM_MODEL")
    host: str = setting("127.0.0.1", "listen address of the public API", env="TANDEM_GATEWAY_HOST")
    port: int = setting(
        50051, "listen port of the public API (0 = any free port)", env="TANDEM_GATEWAY_PORT"
    )
    scheduler: str = setting(
        "127.0.0.1:50052", "scheduler address host:port", env="TANDEM_GATEWAY_SCHEDULER"
    )
    default_max_tokens: int = setting(
        4096,
        "max_tokens when a request leaves it unset (further capped by the context)",
        env="TANDEM_DEFAULT_MAX_TOKENS",
    )
    scheduler_ready_timeout_s: float = setting(
        900.0,
        "seconds to wait for the scheduler to report the model",
        env="TANDEM_SCHEDULER_READY_TIMEOUT_S",
    )
    api_key: str = _secret_setting(
        "require `authorization: Bearer KEY` on every GenerateService call (empty = no auth)",
        env="TANDEM_API_KEY",
    )
    api_key_file: str = setting(
        "", "read the API key from this file instead of --api-key", env="TANDEM_API_KEY_FILE"
    )
    max_request_bytes: str = setting(
        "16MiB",
        "largest request message the public API accepts (larger: RESOURCE_EXHAUSTED)",
        env="TANDEM_GATEWAY_MAX_REQUEST_BYTES",
    )
    drain_timeout_s: float = setting(
        30.0,
        "on SIGTERM: seconds to let open streams finish (new requests get UNAVAILABLE)",
        env="TANDEM_DRAIN_TIMEOUT_S",
    )
    scheduler_health_interval_s: float = setting(
        1.0,
        "seconds between checks of the scheduler's health (the gateway mirrors it)",
        env="TANDEM_SCHEDULER_HEALTH_INTERVAL_S",
    )
    log_level: str = setting("info", "debug, info, warning or error", env="TANDEM_LOG_LEVEL")

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model is required: --model FOLDER or TANDEM_MODEL")
        check_port(self.port, "port")
        parse_address(self.scheduler, "scheduler")
        if not 1024 <= parse_size(self.max_request_bytes) <= 1 << 30:
            raise ValueError(
                f"max_request_bytes must be in 1KiB..1GiB, got {self.max_request_bytes!r}"
            )
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if not self.scheduler_health_interval_s > 0:
            raise ValueError(
                "scheduler_health_interval_s must be positive, "
                f"got {self.scheduler_health_interval_s}"
            )
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if not self.scheduler_ready_timeout_s > 0:
            raise ValueError(
                f"scheduler_ready_timeout_s must be positive, got {self.scheduler_ready_timeout_s}"
            )
        if self.api_key and self.api_key_file:
            raise ValueError("set api_key or api_key_file, not both")
        if self.api_key:
            _check_key(self.api_key, "api_key")
        if self.api_key_file:
            _check_key(read_key_file(self.api_key_file), f"the key in {self.api_key_file!r}")

    @property
    def resolved_api_key(self) -> str:
        """The key clients must present ('' = authentication off)."""
        return read_key_file(self.api_key_file) if self.api_key_file else self.api_key
