"""The scheduler's engine: one step loop per worker pool, request placement, and every
request's stream of tokens.

Disaggregated plan: a prompt runs in a prefill pool (chosen by prefix-cache overlap and
load), whose worker samples the first token; the request then moves to a decode pool
through `KvHandoff` (only the KV blocks that pool lacks cross UCX). A worker with role
`both` keeps a request from prompt to finish with no transfer.

Each pool loop is `schedule()` -> send -> receive -> `update()`: the pool's scheduler
plans and applies its own steps; the engine only routes what an update reports (tokens
to the request's stream, finished requests to their end, done prompts to the hand-off).
A decode pool pulls waiting hand-offs as it plans.

Async scheduling: each pool loop keeps up to two steps on the worker's Step stream, so
the worker starts step N+1 as soon as step N ends while the scheduler is still applying
N's tokens. The plan for N+1 counts the token N will sample as pending (the worker
computes it from its own copy), and tokens that arrive for requests finished meanwhile
are dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from common.lifecycle import wait_until
from common.log import get_logger
from common.prefix_hash import root_hash
from common.retention import RetentionLimits
from common.step_result import StepResult
from common.tracing import enabled as tracing_enabled
from services.scheduler.admission import (
    InvalidRequestError,
    OverloadedError,
    check_queue_room,
    validate_request,
)
from services.scheduler.grammar_gate import GrammarGate
from services.scheduler.handle import RequestHandle, Stage, Tokens
from services.scheduler.handoff import KvHandoff, Stranded, TransferFailed
from services.scheduler.kv_retention import retain_sequence
from services.scheduler.link_breaker import LinkBreaker
from services.scheduler.lora_registry import LoraRegistry
from services.scheduler.pool import Pool, pick_prefill_pool
from services.scheduler.pool_monitor import DrainingChanged, PoolMonitor, WorkerFailed
from services.scheduler.pool_scheduler import PoolScheduler
from services.scheduler.recovery import Recovery, Resilience, can_serve
from services.scheduler.request import FinishReason, Request
from services.scheduler.request_table import RequestTable
from services.scheduler.request_trace import RequestTrace, note_scheduled
from services.scheduler.worker_types import WorkerInfo, WorkerUnavailableError

log = get_logger(__name__)

__all__ = ["Engine", "InvalidRequestError", "OverloadedError", "Resilience"]


class Engine:
    def __init__(
        self,
        pools: Sequence[Pool],
        max_model_len: int,
        vocab_size: int,
        *,
        deployment_salt: bytes,
        kv_transfer_timeout_s: float = 60.0,
        kv_transfer_streaming: bool = True,
        async_scheduling: bool = True,
        resilience: Resilience | None = None,
        make_scheduler: Callable[[WorkerInfo], PoolScheduler] | None = None,
        on_serving_change: Callable[[bool], None] | None = None,
        loras: LoraRegistry | None = None,
        retention: RetentionLimits | None = None,
    ) -> None:
        """`make_scheduler` builds the fresh pool of a worker that rejoins after a failure
        (None: failed workers stay out); `on_serving_change` hears when the engine can or
        can no longer serve; `loras`: the LoRA adapters requests may name."""
        roles = {p.info.role for p in pools}
        if not pools:
            raise ValueError("the scheduler needs at least one worker")
        if "both" in roles and roles != {"both"}:
            raise ValueError("mix of 'both' workers with prefill/decode workers is unsupported")
        if roles & {"prefill", "decode"} and roles != {"prefill", "decode"}:
            raise ValueError(
                f"disaggregation needs prefill and decode workers, got {sorted(roles)}"
            )
        self.pools = list(pools)
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.deployment_salt = deployment_salt
        self.max_steps_in_flight = 2 if async_scheduling else 1
        self.resilience = resilience or Resilience()
        self._on_serving_change = on_serving_change
        self.loras = loras or LoraRegistry()
        self.retention = retention or RetentionLimits()  # kv_retention_s's limit
        self.serving = True
        self._tasks: set[asyncio.Task] = set()
        self._loops: dict[int, asyncio.Task] = {}
        self.handoff = KvHandoff(
            [p for p in self.pools if p.info.role == "decode"],
            kv_transfer_timeout_s,
            spawn=self._spawn,
            streaming=kv_transfer_streaming,
            links=LinkBreaker(self.resilience.kv_link_cool_down_s),
        )
        self.grammars = GrammarGate(lambda: self.pools, self._spawn)
        r = self.resilience
        self.monitor = PoolMonitor(r.health_interval_s, r.health_timeout_s, r.health_max_misses)
        self.requests = RequestTable(self.pools, self.handoff)
        self.recovery = Recovery(
            self.requests, self.pools, self.handoff, self.grammars, r, make_scheduler
        )
        self.num_rejected_requests = 0

    @property
    def on_finish(self) -> Callable[[Request, float], None] | None:
        """Called with each finished request and the time (metrics: RequestTimes.observe)."""
        return self.requests.on_finish

    @on_finish.setter
    def on_finish(self, hook: Callable[[Request, float], None] | None) -> None:
        self.requests.on_finish = hook

    @property
    def num_worker_failures(self) -> int:
        return self.recovery.num_worker_failures

    @property
    def num_restarted_requests(self) -> int:
        return self.recovery.num_restarted_requests

    # -- public --------------------------------------------------------------------------
    def start(self) -> None:
        for pool in self.pools:
            self._start_loop(pool)
            self._spawn(self._watch_pool(pool), f"watch-{pool.info.address}")
        self._spawn(self._grammars_done(), "grammars-done")
        self._spawn(self._handoff_events(), "handoff-events")

    def _start_loop(self, pool: Pool) -> None:
        self._loops[id(pool)] = self._spawn(self._run_pool(pool), f"pool-{pool.info.worker_id}")

    def submit(
        self, samples: Sequence[Request], events=None, trace: RequestTrace | None = None
    ) -> list[RequestHandle]:
        """Validate and queue the n samples of one client request (separate requests with
        the same prompt, queued together on one prefill pool so they share its cached
        prompt blocks); their events go to `events` (anything with `put_nowait`; default a
        new asyncio.Queue). Raises InvalidRequestError, OverloadedError (queue full) or
        WorkerUnavailableError; LoraNotFoundError for an adapter that is not served.
        `trace`: the client request's span (request_trace.py), None when not traced."""
        for request in samples:
            self.validate(request)
            rope = self.pools[0].info.model.prompt_rope_key(len(request.prompt_token_ids))
            lora = self.loras.cache_key(request.lora_name)
            request.hash_root = root_hash(self.deployment_salt, request.cache_salt, lora, rope)
            request.update_block_hashes(self.pools[0].blocks.block_size)
        if not self.serving:
            raise WorkerUnavailableError(
                "no healthy worker can serve: every prefill or every decode worker is down"
            )
        self._check_queue_room(samples)
        pool = pick_prefill_pool(self.pools, samples[0])
        if pool is None:
            raise WorkerUnavailableError("no healthy worker can run prompts")
        events = asyncio.Queue() if events is None else events
        self.grammars.hold(samples)  # a new constraint compiles on the workers first
        if trace is not None:
            trace.adopt(samples)
        handles = []
        try:
            for request in samples:
                handle = RequestHandle(request=request, pool=pool, events=events, trace=trace)
                self.requests.add(handle)
                handles.append(handle)
                pool.scheduler.add(request)
        except Exception:  # all or nothing: what was queued leaves without a word
            for handle in handles:
                self.requests.release(handle)
                handle.finish()
                self.requests.handles.pop(handle.request.request_id, None)
            raise
        pool.wakeup.set()
        return handles

    async def _grammars_done(self) -> None:
        """Requests whose grammar compiled run; those whose grammar was refused end."""
        while True:
            done = await self.grammars.results.get()
            for request in done.requests:
                handle = self.requests.of(request)
                if handle is None:
                    continue  # aborted while its grammar compiled
                try:
                    if done.refusal is not None:
                        error = ("INVALID_ARGUMENT", done.refusal)
                        self.requests.finish(handle, FinishReason.ABORT, error)
                    handle.pool.wakeup.set()
                except Exception as exc:  # its own bookkeeping: it alone fails
                    self.requests.fail_alone(request, exc)

    async def _handoff_events(self) -> None:
        """Act on what the hand-off reports (`KvHandoff.events`), for ever; an event about a
        request that moved on since (cancelled, started over) is stale."""
        while True:
            event = await self.handoff.events.get()
            handle = event.handle
            if handle.done or handle.moves != event.moves:
                continue
            try:
                if isinstance(event, Stranded):
                    self.requests.finish(handle, FinishReason.ABORT, ("UNAVAILABLE", event.why))
                elif isinstance(event, TransferFailed):
                    self.recovery.transfer_failed(handle, event.src, event.dst, event.error)
                    self._spawn(self._recover_transfer(event), "kv-recover")
                else:  # Parked
                    reason = handle.request.finish_reason
                    self.requests.emit_finish(handle, reason, None, parked=True)
            except Exception as exc:  # its own bookkeeping: it alone fails
                self.requests.fail_alone(handle.request, exc)

    async def _recover_transfer(self, event: TransferFailed) -> None:
        """Fail whichever side of a failed transfer does not answer, then start the
        request over."""
        why = str(event.error)
        for pool in await self.recovery.broken_pools(event.src, event.dst):
            self._fail_pool(pool, f"unreachable after a failed KV transfer ({why})")
        self.recovery.restart(event.handle, f"KV transfer failed: {why}")

    async def _watch_pool(self, pool: Pool) -> None:
        """Act on what the pool's health checks show (`PoolMonitor.watch`), for ever."""
        async for event in self.monitor.watch(pool):
            if isinstance(event, WorkerFailed):
                self._fail_pool(pool, event.why)
            elif isinstance(event, DrainingChanged):
                self._set_draining(pool, event.draining)
            else:  # WorkerBack
                try:
                    if await self.recovery.rejoin(pool, self.loras):
                        self._start_loop(pool)
                        self._update_serving()
                except Exception as exc:  # not ready after all, or now incompatible
                    log.warning("rejoin_failed", address=pool.info.address, error=str(exc))

    def _fail_pool(self, pool: Pool, why: str) -> None:
        """Stop the failed worker's step loop (unless this is that loop, ending); its
        requests start over elsewhere (`Recovery.fail_pool`)."""
        if not pool.healthy:
            return
        loop = self._loops.pop(id(pool), None)
        if loop is not None:
            loop.cancel()
        self.recovery.fail_pool(pool, why)
        self._update_serving()

    def _set_draining(self, pool: Pool, draining: bool) -> None:
        self.recovery.set_draining(pool, draining)
        self._update_serving()

    def _update_serving(self) -> None:
        serving = can_serve(self.pools, self.handoff.decode_pools)
        if serving != self.serving:
            self.serving = serving
            log.warning("engine_serving" if serving else "engine_not_serving")
            if self._on_serving_change is not None:
                self._on_serving_change(serving)

    def requests_using(self, lora_name: str) -> int:
        """Requests not finished (queued, running or preempted) on LoRA adapter `lora_name`."""
        return sum(h.request.lora_name == lora_name for h in self.requests)

    def abort(self, request_id: str) -> bool:
        """End a running request now (the client cancelled): its blocks, queues and
        transfers are released at once; a step in flight that carries it is dropped from
        the worker's batch by the next plan, and its tokens are discarded."""
        handle = self.requests.get(request_id)
        if handle is None:
            return False
        try:
            self.requests.finish(handle, FinishReason.ABORT)
        except Exception as exc:
            self.requests.fail_alone(handle.request, exc)
        return True

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def num_waiting(self) -> tuple[int, int]:
        """(requests, tokens) queued in the pools and not yet running."""
        waiting = [r for p in self.pools for r in p.scheduler.waiting]
        return len(waiting), sum(r.num_uncomputed_tokens for r in waiting)

    def _check_queue_room(self, samples: Sequence[Request]) -> None:
        try:
            check_queue_room(self.num_waiting, samples, self.resilience)
        except OverloadedError:
            self.num_rejected_requests += 1
            raise

    def check_integrity(self) -> list[str]:
        """Every pool's invariants; returns the violations found (empty = sound)."""
        errors = []
        for pool in self.pools:
            try:
                pool.scheduler.check_integrity()
            except AssertionError as exc:
                errors.append(f"{pool.info.worker_id}: {exc}")
        return errors

    async def drain(self, timeout_s: float) -> bool:
        """Wait until every request has finished (True) or timeout_s passed (False)."""
        return await wait_until(lambda: not self.requests.handles, timeout_s)

    async def close(self) -> None:
        for pool in self.pools:
            pool.stop_receiving()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(p.client.close() for p in self.pools), return_exceptions=True)

    # -- validation and placement -----------------------------------------------------------
    def validate(self, request: Request) -> None:
        """Raise InvalidRequestError naming the field and the limit a request breaks."""
        validate_request(request, self.requests.handles, self.vocab_size, self.max_model_len)

    # -- the step loop ------------------------------------------------------------------------
    async def _run_pool(self, pool: Pool) -> None:
        while True:
            try:
                await self._advance(pool)
            except WorkerUnavailableError as exc:
                self._loops.pop(id(pool), None)  # this task ends here: nothing to cancel
                self._fail_pool(pool, str(exc))
                return
            except Exception as exc:  # a bug in the pool's own plan or update (a request's
                # own bookkeeping fails that request alone: `_fail_alone`); its requests
                # fail rather than the service stopping
                log.exception("step_failed", worker_id=pool.info.worker_id)
                error = ("INTERNAL", f"step failed: {exc}")
                for handle in [h for h in self.requests if h.pool is pool]:
                    self.requests.finish(handle, FinishReason.ABORT, error)
                await asyncio.sleep(0.1)

    async def _advance(self, pool: Pool) -> None:
        """Send the next plan if a slot is free, else apply the oldest result, else sleep."""
        if pool.scheduler.num_steps_in_flight < self.max_steps_in_flight:
            pool.wakeup.clear()
            if pool.info.role == "decode":
                self.handoff.pull(pool)
                self.recovery.migrate(pool)  # draining: what is idle here leaves with its KV
            plan = pool.scheduler.schedule()
            for victim in plan.swapped_out:
                if not victim.restartable:  # its driver starts it over (`Request.restartable`)
                    self.requests.lose(self.requests.of(victim), "swapped out")
            for victim in plan.preempted:
                if victim.restartable:
                    self.requests.requeue(self.requests.of(victim))
                else:
                    self.requests.lose(self.requests.of(victim), "preempted")
            if not plan.is_empty:
                chunks = self._prompt_chunks(pool, plan)  # noted before the send's await
                step_id = await pool.client.send_step(plan)
                if plan.only_awaits_kv:  # idle, waiting on its KV loads
                    pool.idle_since_last_result = True  # (its wait is no step overhead)
                if tracing_enabled():  # one check per step
                    note_scheduled(plan, self.requests.handles, pool.info.worker_id, step_id)
                self._stream_chunks(pool, step_id, chunks)
                return
        if pool.scheduler.num_steps_in_flight:
            result = await pool.next_result(self.max_steps_in_flight)
            if result is None:
                return  # woken with room for a plan: plan before the result comes
            pool.counters.record_step(result, pool.idle_since_last_result)
            pool.idle_since_last_result = False
            if result.draining and not pool.draining:  # sooner than its health check says
                self._set_draining(pool, True)
            self._apply(pool, result)
            return
        pool.idle_since_last_result = True
        await asyncio.sleep(0)  # never starve other tasks, even if woken already
        await pool.wakeup.wait()

    def _prompt_chunks(self, pool: Pool, plan) -> list[tuple[RequestHandle, int, bool]]:
        """The prompt chunks a prefill pool's plan computes, as (handle, its `moves` now,
        last chunk), noted before the plan is sent (none in a pool that decodes)."""
        if pool.scheduler.runs_decodes:
            return []
        chunks = []
        for item in plan.scheduled:
            handle = self.requests.of(item.request)
            if handle is not None:
                chunks.append((handle, handle.moves, item.samples))
        return chunks

    def _stream_chunks(self, pool: Pool, step_id: int, chunks) -> None:
        """Step `step_id` is sent: each prompt chunk's KV may stream to its decode pool now
        (the hand-off's `stream`). A request that moved while the send was awaited (the
        client cancelled it, or it started over) is left alone: what it held is released,
        and the next plan drops it from the worker's batch."""
        for handle, moves, last in chunks:
            if handle.moves != moves:
                continue
            try:
                if last:  # the prompt's last chunk
                    handle.prompt_step = (pool, step_id)
                self.handoff.stream(handle, step_id, last=last)
            except Exception as exc:
                self.requests.fail_alone(handle.request, exc)

    def _apply(self, pool: Pool, result: StepResult) -> None:
        """Route what the pool's scheduler made of a step's result. An unexpected error in
        one request's part fails that request alone (INTERNAL), never its neighbours."""
        update = pool.scheduler.update(result)
        for request_id in update.unexpected:
            log.warning("unexpected_token", request_id=request_id, step=result.step_id)
        for item in update.tokens:
            try:
                self._route_token(pool, item)
            except Exception as exc:
                self.requests.fail_alone(item.request, exc)
        for request, exc in update.failed:
            self.requests.fail_alone(request, exc)
        for request in update.ready_for_handoff:
            try:
                self.handoff.enqueue(self.requests.of(request))
            except Exception as exc:
                self.requests.fail_alone(request, exc)

    def _route_token(self, pool: Pool, item) -> None:
        """One sampled token (`item`: a SampledToken) to its request's stream."""
        request = item.request
        handle = self.requests.of(request)
        handle.events.put_nowait(
            Tokens(
                request.index,
                [item.token_id],
                [item.logprob] if item.logprob else [],
                item.prompt_logprobs,
                max(0, request.num_cached_tokens) if len(request.output_token_ids) == 1 else None,
            )
        )
        if handle.pool is not pool:
            handle.pool.wakeup.set()  # preempted meanwhile: it waited for this token
        if item.finish_reason is not None:
            if request.keep_kv:
                self.requests.park(handle)
            else:
                self.requests.finish(handle, item.finish_reason)

    def fork(self, parent_id: str, child: Request, events) -> RequestHandle:
        """Queue `child` where parked request `parent_id` keeps its KV, sharing its blocks
        (copied on write): the child's computed tokens are the parent's; its events go to
        `events`. Raises KeyError when the parent keeps no KV (released, or lost)."""
        parent = self.requests.get(parent_id)
        if parent is None or parent.stage is not Stage.PARKED or not parent.pool.healthy:
            raise KeyError(f"request {parent_id!r} keeps no KV")
        pool = parent.pool
        if child.num_computed_tokens != parent.request.num_computed_tokens:
            raise ValueError(
                f"{child.request_id}: {child.num_computed_tokens} tokens computed, its parent "
                f"{parent_id} holds {parent.request.num_computed_tokens}"
            )
        child.hash_root = parent.request.hash_root
        shared = child.num_computed_tokens // pool.blocks.block_size  # full blocks in common
        child.block_hashes = list(parent.request.block_hashes[:shared])
        pool.blocks.fork(parent_id, child.request_id)
        stage = Stage.DECODE if pool.info.role == "decode" else Stage.PREFILL
        handle = RequestHandle(request=child, pool=pool, stage=stage, events=events)
        self.requests.add(handle)
        pool.scheduler.add(child, front=True)
        pool.wakeup.set()
        return handle

    def count_restart(self) -> None:
        """A driver started a client request over (`restarted_requests` in pool stats)."""
        self.recovery.num_restarted_requests += 1

    def release_kv(self, request_id: str) -> None:
        """Free what a parked request keeps (nothing if it is not parked)."""
        self.requests.release_kv(request_id)

    def retain_kv(self, parked_ids: Sequence[str], sequences: Sequence[Request]) -> None:
        """Keep the KV of `sequences` (never submitted: a beam search's hypotheses, with
        their tokens, computed tokens and `kv_retention_s`) as a finished request's is kept
        (`kv_retention.retain_sequence`), in each pool where one of `parked_ids` is parked
        (their chains' hash root). Call before releasing them."""
        pools: dict[int, RequestHandle] = {}
        for request_id in parked_ids:
            handle = self.requests.get(request_id)
            if handle is not None and handle.stage is Stage.PARKED:
                pools.setdefault(id(handle.pool), handle)
        for handle in pools.values():
            pool = handle.pool
            for sequence in sequences:
                sequence.hash_root, sequence.block_hashes = handle.request.hash_root, []
                retain_sequence(pool.blocks, pool.scheduler.offload, sequence)
            pool.wakeup.set()  # deadlines of blocks on disk only go with its next plan

    def _spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task_crashed", task=task.get_name(), error=repr(task.exception()))
