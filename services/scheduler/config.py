"""Settings of the scheduler process (`python -m services.scheduler --help`)."""

from __future__ import annotations

from dataclasses import dataclass

from common.config import check_port, parse_address, setting
from services.scheduler.pool_scheduler import PREEMPTION_MODES


@dataclass(frozen=True)
class SchedulerConfig:
    """The Tandem scheduler: queues, block managers, and the plan for every worker."""

    workers: tuple[str, ...] = setting(
        (),
        "comma-separated worker addresses host:port (roles come from the workers)",
        env="TANDEM_SCHEDULER_WORKERS",
    )
    host: str = setting(
        "127.0.0.1", "listen address (loopback by default)", env="TANDEM_SCHEDULER_HOST"
    )
    port: int = setting(50052, "listen port (0 = any free port)", env="TANDEM_SCHEDULER_PORT")
    max_num_batched_tokens: int = setting(
        2048,
        "token budget of one step on one worker (longer prompts are chunked)",
        env="TANDEM_MAX_NUM_BATCHED_TOKENS",
    )
    max_num_seqs: int = setting(
        128, "requests running at once on one worker", env="TANDEM_MAX_NUM_SEQS"
    )
    worker_ready_timeout_s: float = setting(
        600.0,
        "seconds to wait for every worker to load and answer",
        env="TANDEM_WORKER_READY_TIMEOUT_S",
    )
    kv_transfer_timeout_s: float = setting(
        60.0,
        "seconds before a prefill -> decode KV transfer is given up",
        env="TANDEM_KV_TRANSFER_TIMEOUT_S",
    )
    preemption_mode: str = setting(
        "recompute",
        "when a pool runs out of blocks: recompute (drop the KV, recompute it later) or "
        "swap (copy it to the worker's CPU swap space and back)",
        choices=PREEMPTION_MODES,
        env="TANDEM_PREEMPTION_MODE",
    )
    async_scheduling: bool = setting(
        True,
        "keep one step in flight ahead so scheduling overlaps the model step",
        env="TANDEM_ASYNC_SCHEDULING",
    )
    prefix_cache_salt: str = setting(
        "",
        "deployment salt mixed into every prefix-cache hash (default: random per start)",
        env="TANDEM_PREFIX_CACHE_SALT",
    )
    enable_prefix_caching: bool = setting(
        True,
        "reuse the KV of prompt prefixes already in a pool (automatic prefix caching)",
        env="TANDEM_ENABLE_PREFIX_CACHING",
    )
    max_waiting_requests: int = setting(
        1024,
        "requests that may wait for a worker; more get RESOURCE_EXHAUSTED",
        env="TANDEM_MAX_WAITING_REQUESTS",
    )
    max_waiting_tokens: int = setting(
        1 << 20,
        "prompt tokens that may wait for a worker; more get RESOURCE_EXHAUSTED",
        env="TANDEM_MAX_WAITING_TOKENS",
    )
    max_restarts: int = setting(
        3,
        "times a request starts over after worker or transfer failures before it fails",
        env="TANDEM_MAX_RESTARTS",
    )
    worker_health_interval_s: float = setting(
        1.0, "seconds between health checks of each worker", env="TANDEM_WORKER_HEALTH_INTERVAL_S"
    )
    worker_health_timeout_s: float = setting(
        5.0, "seconds a worker health check may take", env="TANDEM_WORKER_HEALTH_TIMEOUT_S"
    )
    worker_health_max_misses: int = setting(
        5,
        "unanswered health checks in a row after which a worker counts as failed",
        env="TANDEM_WORKER_HEALTH_MAX_MISSES",
    )
    step_timeout_s: float = setting(
        600.0,
        "seconds a worker may take to answer one step before it counts as failed",
        env="TANDEM_STEP_TIMEOUT_S",
    )
    drain_timeout_s: float = setting(
        30.0,
        "on SIGTERM: seconds to let running requests finish (new ones are refused)",
        env="TANDEM_DRAIN_TIMEOUT_S",
    )
    log_level: str = setting("info", "debug, info, warning or error", env="TANDEM_LOG_LEVEL")

    def __post_init__(self) -> None:
        if not self.workers:
            raise ValueError(
                "workers is required: --workers host:port[,host:port...] "
                "or TANDEM_SCHEDULER_WORKERS"
            )
        for address in self.workers:
            parse_address(address, "each worker address")
        if len(set(self.workers)) != len(self.workers):
            raise ValueError(f"workers lists an address twice: {', '.join(self.workers)}")
        check_port(self.port, "port")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if not self.kv_transfer_timeout_s > 0:
            raise ValueError(
                f"kv_transfer_timeout_s must be positive, got {self.kv_transfer_timeout_s}"
            )
        for name in ("max_waiting_requests", "max_waiting_tokens", "worker_health_max_misses"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        for name in (
            "worker_health_interval_s",
            "worker_health_timeout_s",
            "step_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if not self.worker_ready_timeout_s > 0:
            raise ValueError(
                f"worker_ready_timeout_s must be positive, got {self.worker_ready_timeout_s}"
            )
