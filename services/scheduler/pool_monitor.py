"""Watches one worker's health while the engine uses it, and brings it back after a failure.

Every `interval_s` the worker's grpc.health.v1 status is read (with `timeout_s`):
- a worker that does not answer `max_misses` times in a row (killed, hung, stopped,
  partitioned) while no step result arrives from it either is failed: its requests start
  over elsewhere (a busy worker whose health answer is late is not);
- a worker that answers NOT_SERVING is draining: no new requests go to it, the ones it has
  finish;
- a failed worker that answers SERVING again (restarted) rejoins with an empty pool;
- a worker whose health answer names another boot id than it described at connection
  (`WorkerInfo.boot_id`) is a new process, however quickly it came back (a drain and a
  restart within the misses' window answer SERVING throughout): failed at once, its
  requests start over, and it rejoins (a fresh step stream) as soon as it serves.
A dead Step stream fails the worker at once, without waiting for the monitor.

The monitor says what it saw (`watch` yields `WorkerFailed`, `DrainingChanged`, `WorkerBack`);
the engine acts on it (`Engine._watch_pool`), and the watch goes on once it has.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from services.scheduler.pool import Pool


@dataclass(frozen=True)
class WorkerFailed:
    """It missed `max_misses` health checks in a row with no step result meanwhile."""

    why: str


@dataclass(frozen=True)
class DrainingChanged:
    """It answers NOT_SERVING (draining), or SERVING again."""

    draining: bool


@dataclass(frozen=True)
class WorkerBack:
    """A failed worker answers SERVING: it may rejoin."""


HealthEvent = WorkerFailed | DrainingChanged | WorkerBack


def restarted(known: str, answered: str) -> bool:
    """Whether a health answer's boot id says the worker is another process ('' on
    either side: unknown, an older worker)."""
    return bool(known and answered and known != answered)


class PoolMonitor:
    def __init__(self, interval_s: float, timeout_s: float, max_misses: int) -> None:
        """Settings come checked by SchedulerConfig (worker_health_*)."""
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.max_misses = max_misses

    async def watch(self, pool: Pool) -> AsyncIterator[HealthEvent]:
        """What the pool's health checks show, as it changes (for ever)."""
        misses, steps_seen = 0, pool.counters.steps
        while True:
            await asyncio.sleep(self.interval_s)
            status, boot_id = await pool.client.health_boot(self.timeout_s)
            if pool.counters.steps != steps_seen:  # step results arrived: it is alive
                steps_seen = pool.counters.steps
                if status == "UNREACHABLE":
                    misses = 0
                    continue
            if pool.healthy and restarted(pool.info.boot_id, boot_id):
                yield WorkerFailed(
                    f"worker {pool.info.worker_id} restarted (boot id {pool.info.boot_id} "
                    f"-> {boot_id}): its batch and KV are gone"
                )
            if not pool.healthy:
                misses = 0
                if status == "SERVING":
                    yield WorkerBack()
                continue
            if status == "UNREACHABLE":
                misses += 1
                if misses >= self.max_misses:
                    yield WorkerFailed(
                        f"worker {pool.info.worker_id} did not answer health checks "
                        f"{misses} times in a row ({self.timeout_s}s timeout)"
                    )
                continue
            misses = 0
            draining = status != "SERVING"
            if draining != pool.draining:
                yield DrainingChanged(draining)
