"""What the engine does when a worker or a transfer fails, or a worker drains or comes
back: requests start over from prompt + tokens so far (their KV is lost; the tokens
already streamed stay and none is repeated), a failed worker leaves placement, a rejoining
one gets an empty pool, and the engine reports whether it can still serve. A draining
decode worker's requests move to a decode pool that accepts, KV and all, and go on there
with nothing recomputed; with none accepting, they run to the end where they are.

A mixin of `Engine` (it uses the engine's pools, handles, hand-off and finishing).
"""

from __future__ import annotations

import asyncio

from common.log import bind_request, get_logger
from services.scheduler.handle import RequestHandle, Stage
from services.scheduler.handoff import Stranded, TransferFailed
from services.scheduler.lora_admin import sync_worker
from services.scheduler.pool import Pool
from services.scheduler.pool_monitor import DrainingChanged, WorkerFailed
from services.scheduler.request import FinishReason

log = get_logger(__name__)


class Recovery:
    async def handoff_events(self) -> None:
        """Act on what the hand-off reports (`KvHandoff.events`), for ever; an event about a
        request that moved on since (cancelled, started over) is stale."""
        while True:
            event = await self.handoff.events.get()
            handle = event.handle
            if handle.done or handle.moves != event.moves:
                continue
            try:
                if isinstance(event, Stranded):
                    self._finish(handle, FinishReason.ABORT, ("UNAVAILABLE", event.why))
                elif isinstance(event, TransferFailed):
                    self._transfer_failed(handle, event.src, event.dst, event.error)
                else:  # Parked
                    self._emit_finish(handle, handle.request.finish_reason, None, parked=True)
            except Exception as exc:  # its own bookkeeping: it alone fails
                self._fail_alone(handle.request, exc)

    async def watch_pool(self, pool: Pool) -> None:
        """Act on what the pool's health checks show (`PoolMonitor.watch`), for ever."""
        async for event in self.monitor.watch(pool):
            if isinstance(event, WorkerFailed):
                self._fail_pool(pool, event.why)
            elif isinstance(event, DrainingChanged):
                self._set_draining(pool, event.draining)
            else:  # WorkerBack
                try:
                    await self._rejoin(pool)
                except Exception as exc:  # not ready after all, or now incompatible
                    log.warning("rejoin_failed", address=pool.info.address, error=str(exc))

    def _restart(self, handle: RequestHandle, why: str) -> None:
        """Start a request over from its prompt + tokens so far (its KV is lost): the
        tokens already streamed stay, the next one is computed again, none is repeated."""
        if handle.done:
            return
        if not handle.request.restartable:  # its driver starts it over
            self._lose(handle, why)
            return
        self._release(handle)
        handle.num_restarts += 1
        if handle.num_restarts > self.resilience.max_restarts:
            self._finish(
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
        self._requeue(handle)

    def _fail_pool(self, pool: Pool, why: str) -> None:
        """The worker is gone or hung: stop using it; its requests start over elsewhere."""
        if not pool.healthy:
            return
        pool.healthy = False
        self.num_worker_failures += 1
        self.handoff.links.forget(pool.info.worker_id)
        log.error("worker_failed", worker_id=pool.info.worker_id, error=why)
        loop = self._loops.pop(id(pool), None)
        if loop is not None:
            loop.cancel()
        pool.stop_receiving()
        pool.client.close_step_stream()
        affected = [
            h
            for h in self._handles.values()
            if (h.transfer is not None and pool in (h.transfer.src, h.transfer.dst))
            or (h.transfer is None and h.pool is pool and h.stage is not Stage.RECOVERING)
        ]
        for handle in affected:
            self._restart(handle, f"worker {pool.info.worker_id} failed: {why}")
        self._forget_lost_tokens(pool)
        # Its transfers are cancelled now; the worker forgets every receive anyway.
        pool.scheduler.forget_cancelled_transfers()
        self._update_serving()
        self._plan_migrations()
        if not self.handoff.fail_if_stranded():
            self.handoff.wake_decode_pools()

    def _forget_lost_tokens(self, pool: Pool) -> None:
        """Requests the dead worker's unanswered steps sample for that already left its pool
        (preempted while the token was on the way; their new pool waits for it before
        recomputing them): the token never comes, so they stop waiting for it."""
        for request in pool.scheduler.requests_in_flight():
            handle = self._handle_of(request)
            if handle is None or handle.done or handle.pool is pool:
                continue
            if request.num_pending_tokens or request.num_lookahead_in_flight:
                request.num_pending_tokens = 0
                request.num_lookahead_in_flight = 0
                handle.pool.wakeup.set()

    def _transfer_failed(self, handle: RequestHandle, src: Pool, dst: Pool, error) -> None:
        """The transfer's blocks are released (the decode side's held until its tag is
        sent). Find out which worker broke (it does not answer a health check), fail it,
        then start the request over."""
        handle.hold_nothing()
        with bind_request(handle.request.request_id, handle.request.trace_id):
            log.warning(
                "kv_transfer_failed",
                src=src.info.worker_id,
                dst=dst.info.worker_id,
                error=str(error),
            )
        self._spawn(self._recover_transfer(handle, src, dst, str(error)), "kv-recover")

    async def _recover_transfer(self, handle: RequestHandle, src: Pool, dst: Pool, why: str):
        statuses = await asyncio.gather(
            *(p.client.health(self.resilience.health_timeout_s) for p in (src, dst))
        )
        for pool, status in zip((src, dst), statuses, strict=True):
            if status == "UNREACHABLE":
                self._fail_pool(pool, f"unreachable after a failed KV transfer ({why})")
        self._restart(handle, f"KV transfer failed: {why}")

    def _set_draining(self, pool: Pool, draining: bool) -> None:
        pool.draining = draining
        log.info("worker_draining" if draining else "worker_serving", worker_id=pool.info.worker_id)
        self._update_serving()
        self._plan_migrations()
        if not draining:
            self.handoff.wake_decode_pools()

    def _plan_migrations(self) -> None:
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
                self._migrate(pool)
            else:
                for handle in reversed([h for h in self.handoff.queue if h.pool is pool]):
                    self.handoff.remove(handle)
                    handle.stay()
                    pool.scheduler.take_back(handle.request)
            pool.wakeup.set()

    def _migrate(self, pool: Pool) -> None:
        """Hand on what a migrating pool holds with no step in flight (none otherwise)."""
        for request in pool.scheduler.take_migrations():
            self.handoff.enqueue(self._handle_of(request))

    async def _rejoin(self, pool: Pool) -> None:
        """A failed worker answers again: start it over with an empty pool."""
        if self._make_scheduler is None:
            return
        info = await pool.client.wait_ready(timeout_s=self.resilience.health_timeout_s)
        info = await sync_worker(pool.client, info, self.loras)  # before any step
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
        scheduler = self._make_scheduler(info)  # checks its settings before any stream opens
        await pool.client.open_step_stream()
        pool.info = info
        pool.scheduler = scheduler
        pool.idle_since_last_result = True
        pool.draining = False
        pool.healthy = True
        self.handoff.links.forget(info.worker_id)
        log.info("worker_rejoined", worker_id=info.worker_id, address=info.address)
        self._start_loop(pool)
        self._update_serving()
        self._plan_migrations()

    def _update_serving(self) -> None:
        """SERVING needs a worker that runs prompts and, disaggregated, one that decodes."""
        prompts = any(p.accepting and p.runs_prompts for p in self.pools)
        decodes = not self.handoff.decode_pools or any(
            p.accepting for p in self.handoff.decode_pools
        )
        serving = prompts and decodes
        if serving != self.serving:
            self.serving = serving
            log.warning("engine_serving" if serving else "engine_not_serving")
            if self._on_serving_change is not None:
                self._on_serving_change(serving)
