"""Settings of the gateway process (`python -m services.gateway --help`)."""

from __future__ import annotations

from dataclasses import dataclass

from common.config import check_port, parse_address, setting


@dataclass(frozen=True)
class GatewayConfig:
    """The Tandem gateway: public Generate API, validation, tokenization, detokenization."""

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
    log_level: str = setting("info", "debug, info, warning or error", env="TANDEM_LOG_LEVEL")

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model is required: --model FOLDER or TANDEM_MODEL")
        check_port(self.port, "port")
        parse_address(self.scheduler, "scheduler")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if not self.scheduler_ready_timeout_s > 0:
            raise ValueError(
                f"scheduler_ready_timeout_s must be positive, got {self.scheduler_ready_timeout_s}"
            )
