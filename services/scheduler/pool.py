"""One worker as the engine sees it: its connection, its pool scheduler, and its counters."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from common.step_result import StepResult
from services.scheduler.block_manager import BlockManager
from services.scheduler.pool_scheduler import PoolScheduler
from services.scheduler.worker_types import WorkerConnection, WorkerInfo


@dataclass
class PoolCounters:
    steps: int = 0
    execute_s: float = 0.0
    # Time between consecutive step results while the pool never went idle in between;
    # minus the execute time it is the per-step scheduling + transport overhead.
    busy_intervals: int = 0
    busy_interval_s: float = 0.0
    busy_execute_s: float = 0.0  # execute time of the steps that closed those intervals
    kv_blocks_received: int = 0
    kv_transfers: int = 0
    kv_source_lag_s: float = 0.0  # summed over pulls that reported it
    kv_blocks_reused: int = 0
    _last_result: float | None = None

    def record_step(self, result: StepResult, was_idle: bool) -> None:
        now = time.perf_counter()
        self.steps += 1
        self.execute_s += result.execute_seconds
        if self._last_result is not None and not was_idle:
            self.busy_intervals += 1
            self.busy_interval_s += now - self._last_result
            self.busy_execute_s += result.execute_seconds
        self._last_result = now

    @property
    def mean_execute_ms(self) -> float:
        return 1e3 * self.execute_s / self.steps if self.steps else 0.0

    @property
    def mean_step_interval_ms(self) -> float:
        return 1e3 * self.busy_interval_s / self.busy_intervals if self.busy_intervals else 0.0

    @property
    def mean_step_overhead_ms(self) -> float:
        """Per busy step: time between results minus that step's execute time."""
        if not self.busy_intervals:
            return 0.0
        return 1e3 * (self.busy_interval_s - self.busy_execute_s) / self.busy_intervals


@dataclass(eq=False)
class Pool:
    info: WorkerInfo
    client: WorkerConnection
    scheduler: PoolScheduler
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    healthy: bool = True
    # The worker reports NOT_SERVING (it is draining): no new requests go to it.
    draining: bool = False
    idle_since_last_result: bool = True
    counters: PoolCounters = field(default_factory=PoolCounters)
    # The wait for the oldest step's result, when the loop may stop waiting to plan.
    receiving: asyncio.Future | None = None

    def stop_receiving(self) -> None:
        if self.receiving is not None:
            self.receiving.cancel()
            self.receiving = None

    @property
    def accepting(self) -> bool:
        """Healthy and not draining: new requests may be placed here."""
        return self.healthy and not self.draining

    @property
    def runs_prompts(self) -> bool:
        return self.info.role in ("prefill", "both")

    @property
    def blocks(self) -> BlockManager:
        return self.scheduler.blocks
