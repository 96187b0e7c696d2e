"""What happens when a worker or a transfer fails, or a worker drains or comes back:
requests start over from prompt + tokens so far (their KV is lost; the tokens already
streamed stay and none is repeated), a failed worker leaves placement, a rejoining one
gets an empty pool. A draining decode worker's requests move to a decode pool that
accepts, KV and all, and go on there with nothing recomputed; with none accepting, they
run to the end where they are.

A component of the engine: it acts on the pools, the hand-off and the request table; the
engine runs the step loops (it stops a failed pool's loop and starts a rejoined one's)
and says whether it can still serve (`can_serve`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from common.log import bind_request, get_logger
from services.scheduler.grammar_gate import GrammarGate
from services.scheduler.handle import RequestHandle, Stage
from services.scheduler.handoff import KvHandoff
from services.scheduler.lora_admin import sync_worker
from services.scheduler.lora_registry import LoraRegistry
from services.scheduler.pool import Pool
from services.scheduler.pool_scheduler import PoolScheduler
from services.scheduler.request import FinishReason
from services.scheduler.request_table import RequestTable
from services.scheduler.worker_types import WorkerInfo, WorkerUnavailableError

log = get_logger(__name__)


@dataclass(frozen=True)
class Resilience:
    """Queue bounds and failure handling (see SchedulerConfig for what each means and
    the checks on them)."""

    max_waiting_requests: int = 1024
    max_waiting_tokens: int = 1 << 20
    max_restarts: int = 3
    health_interval_s: float = 1.0
    health_timeout_s: float = 5.0
    health_max_misses: int = 5
    kv_link_cool_down_s: float = 30.0


def can_serve(pools: Sequence[Pool], decode_pools: Sequence[Pool]) -> bool:
    """SERVING needs a worker that runs prompts and, disaggregated, one that decodes."""
    prompts = any(p.accepting and p.runs_prompts for p in pools)
    return prompts and (not decode_pools or any(p.accepting for p in decode_pools))


class Recovery:
    def __init__(
        self,
        requests: RequestTable,
        pools: list[Pool],
        handoff: KvHandoff,
        grammars: GrammarGate,
        resilience: Resilience,
        make_scheduler: Callable[[WorkerInfo], PoolScheduler] | None,
    ) -> None:
        """`make_scheduler` builds the fresh pool
        of a worker that rejoins (None: failed workers stay out)."""
        self.requests = requests
        self.pools = pools
        self.handoff = handoff
        self.grammars = grammars
        self.resilience = resilience
        self.make_scheduler = make_scheduler
        self.num_worker_failures = 0
        self.num_restarted_requests = 0

    def restart(self, handle: RequestHandle, why: str) -> None:
        """Start a request over from its prompt + tokens so far (its KV is lost): the
        tokens already streamed stay, the next one is computed again, none is repeated."""
        if handle.done:
            return
        if not handle.request.restartable:  # its driver starts it over
            self.requests.lose(handle, why)
            return
        self.requests.release(handle)
        handle.num_restarts += 1
        if handle.num_restarts > self.resilience.max_restarts:
            self.requests.finish(
                handle,
                FinishReason.ABORT,
                ("UNAVAILABLE", f"gave up after {handle.num_restarts - 1} restarts: {why}"),
            )
            return
        request = handle.request
        request.num_computed_tokens = 0
        request.num_pending_tokens = 0  # a dead worker's steps in flight never answer
        request.num_lookahead_in_flight = 0
        self.num_restarted_requests += 1
        with bind_request(request.request_id, request.trace_id):
            log.warning("request_restarted", reason=why, restarts=handle.num_restarts)
        self.requests.requeue(handle)

    def fail_pool(self, pool: Pool, why: str) -> None:
        """The worker is gone or hung: stop using it (its step loop is the engine's to
        stop); its requests start over elsewhere."""
        pool.healthy = False
        self.num_worker_failures += 1
        self.handoff.links.forget(pool.info.worker_id)
        log.error("worker_failed", worker_id=pool.info.worker_id, error=why)
        pool.stop_receiving()
        pool.client.close_step_stream()
        affected = [
            h
            for h in self.requests
            if (h.transfer is not None and pool in (h.transfer.src, h.transfer.dst))
            or (h.transfer is None and h.pool is pool and h.stage is not Stage.RECOVERING)
        ]
        for handle in affected:
            self.restart(handle, f"worker {pool.info.worker_id} failed: {why}")
        self._forget_lost_tokens(pool)
        # Its loads fail (their transfers were restarted above: cancelled already); the
        # worker forgets every load anyway.
        pool.scheduler.peer_loads.fail_all(WorkerUnavailableError(f"worker failed: {why}"))
        self.plan_migrations()
        if not self.handoff.fail_if_stranded():
            self.handoff.wake_decode_pools()

    def _forget_lost_tokens(self, pool: Pool) -> None:
        """Requests the dead worker's unanswered steps sample for that already left its pool
        (preempted while the token was on the way; their new pool waits for it before
        recomputing them): the token never comes, so they stop waiting for it."""
        for request in pool.scheduler.requests_in_flight():
            handle = self.requests.of(request)
            if handle is None or handle.done or handle.pool is pool:
                continue
            if request.num_pending_tokens or request.num_lookahead_in_flight:
                request.num_pending_tokens = 0
                request.num_lookahead_in_flight = 0
                handle.pool.wakeup.set()

    def transfer_failed(self, handle: RequestHandle, src: Pool, dst: Pool, error) -> None:
        """The transfer's blocks are released (the decode side's held until its tag is
        sent); `broken_pools` then finds out which worker broke."""
        handle.hold_nothing()
        with bind_request(handle.request.request_id, handle.request.trace_id):
            log.warning(
                "kv_transfer_failed",
                src=src.info.worker_id,
                dst=dst.info.worker_id,
                error=str(error),
            )

    async def broken_pools(self, *pools: Pool) -> list[Pool]:
        """Those of `pools` whose worker does not answer a health check."""
        statuses = await asyncio.gather(
            *(p.client.health(self.resilience.health_timeout_s) for p in pools)
        )
        return [p for p, s in zip(pools, statuses, strict=True) if s == "UNREACHABLE"]

    def set_draining(self, pool: Pool, draining: bool) -> None:
        pool.draining = draining
        log.info("worker_draining" if draining else "worker_serving", worker_id=pool.info.worker_id)
        self.plan_migrations()
        if not draining:
            self.handoff.wake_decode_pools()

    def plan_migrations(self) -> None:
        """A draining decode pool hands its requests on (with their KV) while another
        decode pool accepts; otherwise it keeps them to the end, taking back those whose
        move has not started (a pool that accepts again must not pull its own)."""
        target = any(p.accepting for p in self.handoff.decode_pools)
        for pool in self.handoff.decode_pools:
            migrate = pool.healthy and pool.draining and target
            if migrate == pool.scheduler.migrating:
                continue
            pool.scheduler.migrating = migrate
            if pool.healthy:
                log.info(
                    "worker_migrating" if migrate else "worker_migration_stopped",
                    worker_id=pool.info.worker_id,
                )
            if migrate:
                self.migrate(pool)
            else:
                for handle in reversed([h for h in self.handoff.queue if h.pool is pool]):
                    self.handoff.remove(handle)
                    handle.stay()
                    pool.scheduler.take_back(handle.request)
            pool.wakeup.set()

    def migrate(self, pool: Pool) -> None:
        """Hand on what a migrating pool holds with no step in flight (none otherwise)."""
        for request in pool.scheduler.take_migrations():
            self.handoff.enqueue(self.requests.of(request))

    async def rejoin(self, pool: Pool, loras: LoraRegistry) -> bool:
        """A failed worker answers again: give it an empty pool and the adapters served now
        (True; the engine starts its step loop). Raises if it came back with another model
        or role."""
        if self.make_scheduler is None:
            return False
        info = await pool.client.wait_ready(timeout_s=self.resilience.health_timeout_s)
        info = await sync_worker(pool.client, info, loras)  # before any step
        self.grammars.forget_prepared()  # it compiled nothing yet
        reference = next((p.info for p in self.pools if p is not pool), pool.info)
        if (
            info.model.num_layers,
            info.model.kv_group_windows,
            info.block_bytes,
            info.block_size,
        ) != (
            reference.model.num_layers,
            reference.model.kv_group_windows,
            reference.block_bytes,
            reference.block_size,
        ) or info.role != pool.info.role:
            raise ValueError(f"worker at {info.address} came back with another model or role")
        scheduler = self.make_scheduler(info)  # checks its settings before any stream opens
        await pool.client.open_step_stream()
        pool.info = info
        pool.scheduler = scheduler
        pool.idle_since_last_result = True
        pool.draining = False
        pool.healthy = True
        self.handoff.links.forget(info.worker_id)
        log.info("worker_rejoined", worker_id=info.worker_id, address=info.address)
        self.plan_migrations()
        return True
