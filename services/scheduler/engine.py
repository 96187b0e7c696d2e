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
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from common.lifecycle import wait_until
from common.log import bind_request, get_logger
from common.prefix_hash import root_hash
from common.step_result import StepResult
from common.tracing import enabled as tracing_enabled
from services.scheduler.admission import (
    InvalidRequestError,
    OverloadedError,
    check_queue_room,
    validate_request,
)
from services.scheduler.finish_log import log_finished
from services.scheduler.grammar_gate import GrammarGate
from services.scheduler.handle import Finished, RequestHandle, Stage, Tokens
from services.scheduler.handoff import KvHandoff
from services.scheduler.link_breaker import LinkBreaker
from services.scheduler.lora_registry import LoraRegistry
from services.scheduler.pool import Pool, pick_prefill_pool
from services.scheduler.pool_monitor import PoolMonitor
from services.scheduler.pool_scheduler import PoolScheduler
from services.scheduler.recovery import Recovery
from services.scheduler.request import FinishReason, Request
from services.scheduler.request_trace import RequestTrace, note_scheduled
from services.scheduler.worker_types import WorkerInfo, WorkerUnavailableError

log = get_logger(__name__)

__all__ = ["Engine", "InvalidRequestError", "OverloadedError", "Resilience"]


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


class Engine(Recovery):
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
        self._make_scheduler = make_scheduler
        self._on_serving_change = on_serving_change
        self.loras = loras or LoraRegistry()
        self.serving = True
        self._handles: dict[str, RequestHandle] = {}
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
        self.num_worker_failures = 0
        self.num_restarted_requests = 0
        self.num_rejected_requests = 0
        # Called with each finished request and the time (metrics: RequestTimes.observe).
        self.on_finish: Callable[[Request, float], None] | None = None

    # -- public --------------------------------------------------------------------------
    def start(self) -> None:
        for pool in self.pools:
            self._start_loop(pool)
            self._spawn(self.watch_pool(pool), f"watch-{pool.info.address}")
        self._spawn(self._grammars_done(), "grammars-done")
        self._spawn(self.handoff_events(), "handoff-events")

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
                self._handles[request.request_id] = handle
                handles.append(handle)
                pool.scheduler.add(request)
        except Exception:  # all or nothing: what was queued leaves without a word
            for handle in handles:
                self._release(handle)
                handle.finish()
                self._handles.pop(handle.request.request_id, None)
            raise
        pool.wakeup.set()
        return handles

    async def _grammars_done(self) -> None:
        """Requests whose grammar compiled run; those whose grammar was refused end."""
        while True:
            done = await self.grammars.results.get()
            for request in done.requests:
                handle = self._handle_of(request)
                if handle is None:
                    continue  # aborted while its grammar compiled
                try:
                    if done.refusal is not None:
                        error = ("INVALID_ARGUMENT", done.refusal)
                        self._finish(handle, FinishReason.ABORT, error)
                    handle.pool.wakeup.set()
                except Exception as exc:  # its own bookkeeping: it alone fails
                    self._fail_alone(request, exc)

    def requests_using(self, lora_name: str) -> int:
        """Requests not finished (queued, running or preempted) on LoRA adapter `lora_name`."""
        return sum(h.request.lora_name == lora_name for h in self._handles.values())

    def abort(self, request_id: str) -> bool:
        """End a running request now (the client cancelled): its blocks, queues and
        transfers are released at once; a step in flight that carries it is dropped from
        the worker's batch by the next plan, and its tokens are discarded."""
        handle = self._handles.get(request_id)
        if handle is None:
            return False
        try:
            self._finish(handle, FinishReason.ABORT)
        except Exception as exc:
            self._fail_alone(handle.request, exc)
        return True

    @property
    def num_requests(self) -> int:
        return len(self._handles)

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
        return await wait_until(lambda: not self._handles, timeout_s)

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
        validate_request(request, self._handles, self.vocab_size, self.max_model_len)

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
                for handle in [h for h in self._handles.values() if h.pool is pool]:
                    self._finish(handle, FinishReason.ABORT, ("INTERNAL", f"step failed: {exc}"))
                await asyncio.sleep(0.1)

    async def _advance(self, pool: Pool) -> None:
        """Send the next plan if a slot is free, else apply the oldest result, else sleep."""
        if pool.scheduler.num_steps_in_flight < self.max_steps_in_flight:
            pool.wakeup.clear()
            if pool.info.role == "decode":
                self.handoff.pull(pool)
                self._migrate(pool)  # draining: what is idle here leaves with its KV
            plan = pool.scheduler.schedule()
            for victim in plan.swapped_out:
                if not victim.restartable:  # its driver starts it over (`Request.restartable`)
                    self._lose(self._handle_of(victim), "swapped out")
            for victim in plan.preempted:
                if victim.restartable:
                    self._requeue(self._handle_of(victim))
                else:
                    self._lose(self._handle_of(victim), "preempted")
            if not plan.is_empty:
                chunks = self._prompt_chunks(pool, plan)  # noted before the send's await
                step_id = await pool.client.send_step(plan)
                if tracing_enabled():  # one check per step
                    note_scheduled(plan, self._handles, pool.info.worker_id, step_id)
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
            handle = self._handle_of(item.request)
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
                self._fail_alone(handle.request, exc)

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
                self._fail_alone(item.request, exc)
        for request, exc in update.failed:
            self._fail_alone(request, exc)
        for request in update.ready_for_handoff:
            try:
                self.handoff.enqueue(self._handle_of(request))
            except Exception as exc:
                self._fail_alone(request, exc)

    def _route_token(self, pool: Pool, item) -> None:
        """One sampled token (`item`: a SampledToken) to its request's stream."""
        request = item.request
        handle = self._handle_of(request)
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
                self._park(handle)
            else:
                self._finish(handle, item.finish_reason)

    def _park(self, handle: RequestHandle) -> None:
        """A request that keeps its KV finished (`Request.keep_kv`): parked where it
        decodes; one that finished in a pool that does not decode hands its KV on to a
        decode pool first and parks where it arrives (`Recovery.handoff_events`)."""
        if handle.pool.scheduler.runs_decodes:
            handle.park()
            self._emit_finish(handle, handle.request.finish_reason, None, parked=True)
        else:
            self.handoff.enqueue(handle)

    def _lose(self, handle: RequestHandle | None, why: str) -> None:
        """A request that does not start over (`Request.restartable`) lost its KV: it ends
        with ABORTED, and its driver decides what follows."""
        if handle is not None:
            self._finish(handle, FinishReason.ABORT, ("ABORTED", f"its KV was lost: {why}"))

    def fork(self, parent_id: str, child: Request, events) -> RequestHandle:
        """Queue `child` where parked request `parent_id` keeps its KV, sharing its blocks
        (copied on write): the child's computed tokens are the parent's; its events go to
        `events`. Raises KeyError when the parent keeps no KV (released, or lost)."""
        parent = self._handles.get(parent_id)
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
        self._handles[child.request_id] = handle
        pool.scheduler.add(child, front=True)
        pool.wakeup.set()
        return handle

    def count_restart(self) -> None:
        """A driver started a client request over (`restarted_requests` in pool stats)."""
        self.num_restarted_requests += 1

    def release_kv(self, request_id: str) -> None:
        """Free what a parked request keeps (nothing if it is not parked)."""
        handle = self._handles.get(request_id)
        if handle is not None and handle.stage is Stage.PARKED:
            self._release(handle)
            handle.finish()
            self._handles.pop(request_id, None)

    def _handle_of(self, request: Request) -> RequestHandle | None:
        """The request's handle while it runs; None once it ended (a handle that now
        holds the same id belongs to a later request)."""
        handle = self._handles.get(request.request_id)
        return handle if handle is not None and handle.request is request else None

    def _fail_alone(self, request: Request, exc: Exception) -> None:
        """A bug met in one request's bookkeeping: that request ends with INTERNAL; the
        pool and the other requests go on."""
        with bind_request(request.request_id, request.trace_id):
            log.error("request_failed", error=repr(exc), exc_info=exc)
        handle = self._handle_of(request)
        if handle is None:
            return
        error = ("INTERNAL", f"request failed: {exc!r}")
        try:
            self._finish(handle, FinishReason.ABORT, error)
        except Exception:  # its release failed too: end its stream all the same
            log.exception("request_release_failed", request_id=request.request_id)
            if not handle.done:
                handle.stage = Stage.DONE
                self._emit_finish(handle, FinishReason.ABORT, error)

    def _requeue(self, handle: RequestHandle) -> None:
        """A preempted request recomputes from its prompt + tokens so far in a prefill pool."""
        target = pick_prefill_pool(self.pools, handle.request, allow_draining=True)
        if target is None:
            self._finish(handle, FinishReason.ABORT, ("UNAVAILABLE", "no prefill worker left"))
            return
        handle.queue_prompt(target)
        target.scheduler.add(handle.request, front=True)
        target.wakeup.set()

    # -- finishing ------------------------------------------------------------------------------
    def _finish(
        self, handle: RequestHandle, reason: FinishReason, error: tuple[str, str] | None = None
    ) -> None:
        """Release whatever the request holds and end its stream."""
        if handle.done:
            return
        self._release(handle)
        handle.finish()
        self._emit_finish(handle, reason, error)

    def _release(self, handle: RequestHandle) -> None:
        """Free what the request holds wherever it is (queues, blocks, a transfer in
        flight); it is left RECOVERING, holding nothing."""
        request, stage = handle.request, handle.stage
        handle.hold_nothing()
        if stage in (Stage.PREFILL, Stage.DECODE):
            if handle.transfer is not None:  # streamed while its prompt ran
                self.handoff.cancel(handle, free_source=False)
            handle.pool.scheduler.release(request)
            handle.pool.wakeup.set()
        elif stage is Stage.HANDOFF:
            self.handoff.remove(handle)
            handle.pool.blocks.free(request.request_id)
            handle.pool.wakeup.set()
        elif stage is Stage.TRANSFER:
            self.handoff.cancel(handle)  # both sides freed now (the pools are woken)
        elif stage is Stage.PARKED:
            handle.pool.blocks.free(request.request_id)
            handle.pool.wakeup.set()

    def _emit_finish(
        self,
        handle: RequestHandle,
        reason: FinishReason,
        error: tuple[str, str] | None,
        parked: bool = False,
    ) -> None:
        """The request's Finished event (its handle kept while it is `parked`)."""
        request = handle.request
        if request.finish_reason is None:
            request.finish_reason = reason
        if not parked:
            self._handles.pop(request.request_id, None)
        handle.events.put_nowait(
            Finished(
                index=request.index,
                reason=request.finish_reason,
                prompt_tokens=len(request.prompt_token_ids),
                completion_tokens=len(request.output_token_ids),
                cached_tokens=max(0, request.num_cached_tokens),
                error=error,
                num_draft_tokens=request.num_draft_tokens,
                num_accepted_tokens=request.num_accepted_tokens,
            )
        )
        if not request.counted:  # a part of a client request: its driver ends that
            return
        if handle.trace is not None:
            handle.trace.sample_finished(request, error)
        now = time.monotonic()
        if self.on_finish is not None:
            self.on_finish(request, now)
        log_finished(request, error, now)

    def _spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task_crashed", task=task.get_name(), error=repr(task.exception()))
