"""One worker as the engine sees it: its connection, its pool scheduler, and its counters;
and which pool a prompt runs in."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from common.step_result import StepResult
from services.scheduler.block_manager import BlockManager
from services.scheduler.placement import PrefillCandidate, choose_prefill
from services.scheduler.pool_scheduler import PoolScheduler
from services.scheduler.request import Request
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

    async def next_result(self, max_steps_in_flight: int) -> StepResult | None:
        """The oldest step's result; None when, waiting for it with room for another plan,
        the pool has KV loads to start or cancelled ones to report: a worker that stops
        answering must still get the plan that carries their tags, since their blocks are
        held until it goes. (Other wake-ups wait for the result, as before: planning more
        eagerly would take CPU turns from the other workers' steps.)"""
        if self.receiving is None:
            if self.scheduler.num_steps_in_flight >= max_steps_in_flight:
                return await self.client.receive_step()  # no room to plan: just wait
            self.receiving = asyncio.ensure_future(self.client.receive_step())
        receiving = self.receiving
        while not receiving.done():
            room = self.scheduler.num_steps_in_flight < max_steps_in_flight
            if room and self.scheduler.peer_loads.pending:
                return None  # (without room the plan after this result carries them)
            self.wakeup.clear()  # a plan follows the result anyway
            woken = asyncio.ensure_future(self.wakeup.wait())
            try:
                await asyncio.wait((receiving, woken), return_when=asyncio.FIRST_COMPLETED)
            finally:
                woken.cancel()
        self.receiving = None
        return await receiving


def pick_prefill_pool(
    pools: Sequence[Pool], request: Request, allow_draining: bool = False
) -> Pool | None:
    """The pool a request's prompt runs in (`placement.choose_prefill`); with
    `allow_draining`, a draining one when none accepts (a requeue may still go there)."""
    candidates = [p for p in pools if p.accepting and p.runs_prompts]
    if not candidates and allow_draining:  # requeues may still go to a draining pool
        candidates = [p for p in pools if p.healthy and p.runs_prompts]
    scores = []
    for pool in candidates:
        hits = pool.blocks.cached_prefix(
            request.block_hashes, request.all_token_ids, request.num_known_tokens - 1
        )
        scores.append(
            PrefillCandidate(
                queued_tokens=pool.scheduler.num_queued_tokens,
                cached_tokens=pool.blocks.tokens_in(len(hits)),
                free_blocks=pool.blocks.num_free_blocks,
            )
        )
    choice = choose_prefill(scores, request.num_known_tokens)
    return None if choice is None else candidates[choice]
