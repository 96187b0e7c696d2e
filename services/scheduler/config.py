"""Settings of the scheduler process (`python -m services.scheduler --help`)."""

from __future__ import annotations

from dataclasses import dataclass

from common.config import (
    ServiceConfig,
    drain_timeout_setting,
    host_setting,
    log_level_setting,
    metrics_port_setting,
    port_setting,
    setting,
)
from services.scheduler.pool_scheduler import PREEMPTION_MODES


@dataclass(frozen=True)
class SchedulerConfig(ServiceConfig):
    """The Tandem scheduler: queues, block managers, and the plan for every worker."""

    workers: tuple[str, ...] = setting(
        (),
        "comma-separated worker addresses host:port (roles come from the workers)",
        env="TANDEM_SCHEDULER_WORKERS",
    )
    host: str = host_setting("TANDEM_SCHEDULER_HOST")
    port: int = port_setting(50052, "TANDEM_SCHEDULER_PORT")
    metrics_port: int = metrics_port_setting("TANDEM_SCHEDULER_METRICS_PORT")
    max_num_batched_tokens: int = setting(
        2048,
        "token budget of one step on one worker (longer prompts are chunked); must not "
        "exceed a GPU worker's --profile-num-tokens (checked when the workers connect)",
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
        "seconds before a prefill -> decode KV transfer is given up (the deadline of the "
        "sender's SendKv and of the receiver's KV load); must be >= the workers' "
        "--kv-transfer-timeout-s, "
        "which bounds only the UCX part of the transfer (checked when the workers connect)",
        env="TANDEM_KV_TRANSFER_TIMEOUT_S",
    )
    kv_transfer_streaming: bool = setting(
        True,
        "start a prompt's KV transfer when its last chunk is scheduled, not when it is "
        "done: a same-host decode worker copies each layer as the prefill worker finishes "
        "it (off: the transfer starts after the prompt's result comes back)",
        env="TANDEM_KV_TRANSFER_STREAMING",
    )
    preemption_mode: str = setting(
        "recompute",
        "when a pool runs out of blocks: recompute (drop the KV, recompute it later) or "
        "swap (copy it to the worker's CPU swap space and back)",
        choices=PREEMPTION_MODES,
        env="TANDEM_PREEMPTION_MODE",
    )
    speculative_slots: str = setting(
        "goodput",
        "speculative decoding's proposal slots: goodput (only where they pay for their rows "
        "and a draft model's passes, measured) or all (every slot the config allows, as vLLM)",
        choices=("goodput", "all"),
        env="TANDEM_SPECULATIVE_SLOTS",
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
    enable_kv_cache_events: bool = setting(
        True,
        "publish what the prefix caches gain and lose, as vLLM's KV events, on the KvEvents "
        "stream (a gateway fronting several schedulers routes by them) and the metrics",
        env="TANDEM_ENABLE_KV_CACHE_EVENTS",
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
    kv_link_cool_down_s: float = setting(
        30.0,
        "seconds a prefill -> decode pair whose KV transfer failed (both workers alive: a "
        "cut or partitioned link) is left out of placement; doubled for each failure in a "
        "row, up to 10x",
        env="TANDEM_KV_LINK_COOL_DOWN_S",
    )
    step_timeout_s: float = setting(
        600.0,
        "seconds a worker may take to answer one step before it counts as failed",
        env="TANDEM_STEP_TIMEOUT_S",
    )
    drain_timeout_s: float = drain_timeout_setting(
        "on SIGTERM: seconds to let running requests finish (new ones are refused)"
    )
    max_kv_retention_s: float = setting(
        3600.0,
        "the longest kv_retention_s a request may ask for (seconds its prompt's and "
        "output's KV blocks are evicted last in every tier); longer is INVALID_ARGUMENT",
        env="TANDEM_MAX_KV_RETENTION_S",
    )
    log_level: str = log_level_setting()

    def __post_init__(self) -> None:
        self._check_service()
        self._require(
            0 <= self.max_kv_retention_s < float("inf"),
            "max_kv_retention_s",
            "must be finite and >= 0",
        )
        if not self.workers:
            raise ValueError(
                "workers is required: --workers host:port[,host:port...] "
                "or TANDEM_SCHEDULER_WORKERS"
            )
        for address in self.workers:
            self._address("workers", address)
        if len(set(self.workers)) != len(self.workers):
            raise self._invalid("workers", f"lists an address twice: {', '.join(self.workers)}")
        self._require(
            self.preemption_mode in PREEMPTION_MODES,
            "preemption_mode",
            f"must be one of {', '.join(PREEMPTION_MODES)}",
        )
        self._at_least(
            1,
            "max_num_batched_tokens",
            "max_num_seqs",
            "max_waiting_requests",
            "max_waiting_tokens",
            "worker_health_max_misses",
        )
        self._at_least(0, "max_restarts")
        self._positive(
            "kv_transfer_timeout_s",
            "worker_ready_timeout_s",
            "worker_health_interval_s",
            "worker_health_timeout_s",
            "step_timeout_s",
            "kv_link_cool_down_s",
        )
