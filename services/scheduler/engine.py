"""The scheduler's engine: one step loop per worker pool, request placement, and every
request's stream of tokens.

Disaggregated plan: a prompt runs in a prefill pool (chosen by prefix-cache overlap and
load), whose worker samples the first token; the request then moves to a decode pool
through `KvHandoff` (only the KV blocks that pool lacks cross UCX). A worker with role
`both` keeps a request from prompt to finish with no transfer.

Async scheduling: each pool loop keeps up to two steps on the worker's Step stream, so
the worker starts step N+1 as soon as step N ends while the scheduler is still applying
N's tokens. The plan for N+1 counts the token N will sample as pending (the worker
computes it from its own copy), and tokens that arrive for requests finished meanwhile
are dropped.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from common.log import bind_request, get_logger
from services.scheduler.handle import Finished, RequestHandle, Stage, Tokens
from services.scheduler.handoff import KvHandoff
from services.scheduler.placement import PrefillCandidate, choose_prefill
from services.scheduler.pool import Pool
from services.scheduler.prefix_hash import root_hash
from services.scheduler.request import FinishReason, Request
from services.scheduler.worker_client import StepResult, WorkerUnavailableError

log = get_logger(__name__)


class InvalidRequestError(ValueError):
    """The request breaks a limit; the message names the field and the limit."""


class Engine:
    def __init__(
        self,
        pools: Sequence[Pool],
        max_model_len: int,
        vocab_size: int,
        *,
        deployment_salt: bytes,
        kv_transfer_timeout_s: float = 60.0,
        async_scheduling: bool = True,
    ) -> None:
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
        self._handles: dict[str, RequestHandle] = {}
        self._tasks: set[asyncio.Task] = set()
        self.handoff = KvHandoff(
            [p for p in self.pools if p.info.role == "decode"],
            kv_transfer_timeout_s,
            spawn=self._spawn,
            fail=lambda handle, message: self._finish(
                handle, FinishReason.ABORT, ("UNAVAILABLE", message)
            ),
        )

    # -- public --------------------------------------------------------------------------
    def start(self) -> None:
        for pool in self.pools:
            self._spawn(self._run_pool(pool), f"pool-{pool.info.worker_id}")

    def submit(self, samples: Sequence[Request]) -> list[RequestHandle]:
        """Validate and queue the n samples of one client request (separate requests with
        the same prompt, queued together on one prefill pool so they share its cached
        prompt blocks); their events go to one queue. Raises InvalidRequestError."""
        for request in samples:
            self._validate(request)
            request.hash_root = root_hash(self.deployment_salt, request.cache_salt)
            request.update_block_hashes(self.pools[0].blocks.block_size)
        pool = self._pick_prefill_pool(samples[0])
        if pool is None:
            raise WorkerUnavailableError("no healthy worker can run prompts")
        events: asyncio.Queue = asyncio.Queue()
        handles = []
        for request in samples:
            handle = RequestHandle(request=request, pool=pool, events=events)
            self._handles[request.request_id] = handle
            pool.scheduler.add(request)
            handles.append(handle)
        pool.wakeup.set()
        return handles

    def abort(self, request_id: str) -> bool:
        handle = self._handles.get(request_id)
        if handle is None:
            return False
        self._finish(handle, FinishReason.ABORT)
        return True

    @property
    def num_requests(self) -> int:
        return len(self._handles)

    def check_integrity(self) -> list[str]:
        """Every pool's invariants; returns the violations found (empty = sound)."""
        errors = []
        for pool in self.pools:
            try:
                pool.scheduler.check_integrity()
            except AssertionError as exc:
                errors.append(f"{pool.info.worker_id}: {exc}")
        return errors

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(p.client.close() for p in self.pools), return_exceptions=True)

    # -- validation and placement -----------------------------------------------------------
    def _validate(self, request: Request) -> None:
        n = len(request.prompt_token_ids)
        if request.request_id in self._handles:
            raise InvalidRequestError(f"request_id {request.request_id!r} is already running")
        if n == 0:
            raise InvalidRequestError("prompt_token_ids must not be empty")
        bad = [t for t in request.prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt_token_ids must be in [0, {self.vocab_size}), got {bad[0]}"
            )
        if request.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {request.max_tokens}")
        if n + request.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({n} tokens) + max_tokens ({request.max_tokens}) exceeds the context "
                f"length max_model_len={self.max_model_len}"
            )

    def _pick_prefill_pool(self, request: Request) -> Pool | None:
        candidates = [p for p in self.pools if p.healthy and p.runs_prompts]
        scores = []
        for pool in candidates:
            hits = pool.blocks.cached_prefix(
                request.block_hashes, request.all_token_ids, request.num_known_tokens - 1
            )
            scores.append(
                PrefillCandidate(
                    queued_tokens=pool.scheduler.num_queued_tokens,
                    cached_tokens=len(hits) * pool.blocks.block_size,
                    free_blocks=pool.blocks.num_free_blocks,
                )
            )
        choice = choose_prefill(scores, request.num_known_tokens)
        return None if choice is None else candidates[choice]

    # -- the step loop ------------------------------------------------------------------------
    async def _run_pool(self, pool: Pool) -> None:
        while True:
            try:
                await self._advance(pool)
            except WorkerUnavailableError as exc:
                self._fail_pool(pool, exc)
                return
            except Exception as exc:  # a bug must fail requests, not stop the service
                log.exception("step_failed", worker_id=pool.info.worker_id)
                for handle in [h for h in self._handles.values() if h.pool is pool]:
                    self._finish(handle, FinishReason.ABORT, ("INTERNAL", f"step failed: {exc}"))
                await asyncio.sleep(0.1)

    async def _advance(self, pool: Pool) -> None:
        """Send the next plan if a slot is free, else apply the oldest result, else sleep."""
        if pool.steps_in_flight < self.max_steps_in_flight:
            pool.wakeup.clear()
            plan = pool.scheduler.schedule()
            for victim in plan.preempted:
                self._requeue(self._handles[victim.request_id])
            if not plan.is_empty:
                await pool.client.send_step(plan)
                pool.steps_in_flight += 1
                return
        if pool.steps_in_flight:
            result = await pool.client.receive_step()
            pool.steps_in_flight -= 1
            pool.counters.record_step(result, pool.idle_since_last_result)
            pool.idle_since_last_result = False
            self._apply(pool, result)
            return
        pool.idle_since_last_result = True
        await asyncio.sleep(0)  # never starve other tasks, even if woken already
        await pool.wakeup.wait()

    def _apply(self, pool: Pool, result: StepResult) -> None:
        for request_id, (start, entries) in result.prompt_logprobs.items():
            handle = self._handles.get(request_id)
            if handle is not None and not handle.prompt_logprobs_sent:
                gathered = handle.request.prompt_logprobs
                del gathered[start - 1 :]  # a recompute after preemption resends positions
                gathered.extend(entries)
        for request_id, token in result.sampled.items():
            handle = self._handles.get(request_id)
            if handle is None:
                continue  # finished or aborted while the step ran
            request = handle.request
            if request.num_pending_tokens <= 0:
                log.warning("unexpected_token", request_id=request_id, step=result.step_id)
                continue
            request.num_pending_tokens -= 1
            reason = request.append_token(token)
            prompt_logprobs = []
            if request.sampling.prompt_logprobs is not None and not handle.prompt_logprobs_sent:
                prompt_logprobs, handle.prompt_logprobs_sent = request.prompt_logprobs, True
            logprob = result.logprobs.get(request_id)
            first = len(request.output_token_ids) == 1
            handle.events.put_nowait(
                Tokens(
                    request.index,
                    [token],
                    [logprob] if logprob else [],
                    prompt_logprobs,
                    max(0, request.num_cached_tokens) if first else None,
                )
            )
            if handle.pool is not pool:
                handle.pool.wakeup.set()  # preempted meanwhile: it waited for this token
            if reason is not None:
                self._finish(handle, reason)
            elif (
                pool.info.role == "prefill"
                and handle.pool is pool
                and handle.stage is Stage.PREFILL
                and pool.scheduler.is_running(request)
            ):
                pool.scheduler.detach(request)
                self.handoff.enqueue(handle)
        if self.handoff.queue:
            self.handoff.pump()

    def _requeue(self, handle: RequestHandle) -> None:
        """A preempted request recomputes from its prompt + tokens so far in a prefill pool."""
        target = self._pick_prefill_pool(handle.request)
        if target is None:
            self._finish(handle, FinishReason.ABORT, ("UNAVAILABLE", "no prefill worker left"))
            return
        handle.stage, handle.pool = Stage.PREFILL, target
        target.scheduler.add(handle.request, front=True)
        target.wakeup.set()

    # -- finishing ------------------------------------------------------------------------------
    def _finish(
        self, handle: RequestHandle, reason: FinishReason, error: tuple[str, str] | None = None
    ) -> None:
        """Release whatever the request holds and end its stream."""
        if handle.done:
            return
        request = handle.request
        stage, handle.stage = handle.stage, Stage.DONE
        if stage in (Stage.PREFILL, Stage.DECODE):
            handle.pool.scheduler.release(request)
            handle.pool.wakeup.set()
        elif stage is Stage.HANDOFF:
            self.handoff.remove(handle)
            handle.pool.blocks.free(request.request_id)
            handle.pool.wakeup.set()
        # Stage.TRANSFER: the transfer task frees both sides when it returns.
        self._emit_finish(handle, reason, error)
        if stage is Stage.DECODE and self.handoff.queue:
            self.handoff.pump()  # decode blocks were freed

    def _emit_finish(
        self, handle: RequestHandle, reason: FinishReason, error: tuple[str, str] | None
    ) -> None:
        request = handle.request
        if request.finish_reason is None:
            request.finish_reason = reason
        self._handles.pop(request.request_id, None)
        cached = max(0, request.num_cached_tokens)
        handle.events.put_nowait(
            Finished(
                index=request.index,
                reason=request.finish_reason,
                prompt_tokens=len(request.prompt_token_ids),
                completion_tokens=len(request.output_token_ids),
                cached_tokens=cached,
                error=error,
            )
        )
        now = time.monotonic()
        n_out = len(request.output_token_ids)
        first = request.first_token_time
        with bind_request(request.request_id):
            log.info(
                "request_finished",
                finish_reason=request.finish_reason.value,
                prompt_tokens=len(request.prompt_token_ids),
                output_tokens=n_out,
                cached_tokens=cached,
                preemptions=request.num_preemptions,
                ttft_ms=round((first - request.arrival_time) * 1e3, 2) if first else None,
                mean_itl_ms=round((now - first) * 1e3 / (n_out - 1), 2)
                if first and n_out > 1
                else None,
                error=error[1] if error else None,
            )

    def _fail_pool(self, pool: Pool, exc: Exception) -> None:
        pool.healthy = False
        log.error("worker_failed", worker_id=pool.info.worker_id, error=str(exc))
        for handle in [h for h in self._handles.values() if h.pool is pool]:
            self._finish(handle, FinishReason.ABORT, ("UNAVAILABLE", f"worker failed: {exc}"))

    def _spawn(self, coro, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("task_crashed", task=task.get_name(), error=repr(task.exception()))
