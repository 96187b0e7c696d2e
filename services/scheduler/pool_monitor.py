"""Watches one worker's health while the engine uses it, and brings it back after a failure.

Every `interval_s` the worker's grpc.health.v1 status is read (with `timeout_s`):
- a worker that does not answer `max_misses` times in a row (killed, hung, stopped,
  partitioned) while no step result arrives from it either is failed: its requests start
  over elsewhere (a busy worker whose health answer is late is not);
- a worker that answers NOT_SERVING is draining: no new requests go to it, the ones it has
  finish;
- a failed worker that answers SERVING again (restarted) rejoins with an empty pool.
A dead Step stream fails the worker at once, without waiting for the monitor.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from common.log import get_logger
from services.scheduler.pool import Pool

log = get_logger(__name__)


class PoolMonitor:
    def __init__(
        self,
        interval_s: float,
        timeout_s: float,
        max_misses: int,
        fail: Callable[[Pool, str], None],
        set_draining: Callable[[Pool, bool], None],
        rejoin: Callable[[Pool], Awaitable[None]],
    ) -> None:
        """Settings come checked by SchedulerConfig (worker_health_*)."""
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.max_misses = max_misses
        self._fail = fail
        self._set_draining = set_draining
        self._rejoin = rejoin

    async def watch(self, pool: Pool) -> None:
        misses, steps_seen = 0, pool.counters.steps
        while True:
            await asyncio.sleep(self.interval_s)
            status = await pool.client.health(self.timeout_s)
            if pool.counters.steps != steps_seen:  # step results arrived: it is alive
                steps_seen = pool.counters.steps
                if status == "UNREACHABLE":
                    misses = 0
                    continue
            if not pool.healthy:
                misses = 0
                if status == "SERVING":
                    try:
                        await self._rejoin(pool)
                    except Exception as exc:  # not ready after all, or now incompatible
                        log.warning("rejoin_failed", address=pool.info.address, error=str(exc))
                continue
            if status == "UNREACHABLE":
                misses += 1
                if misses >= self.max_misses:
                    self._fail(
                        pool,
                        f"worker {pool.info.worker_id} did not answer health checks "
                        f"{misses} times in a row ({self.timeout_s}s timeout)",
                    )
                continue
            misses = 0
            draining = status != "SERVING"
            if draining != pool.draining:
                self._set_draining(pool, draining)
