"""The scheduler's engine: one step loop per worker pool, the prefill → decode handoff, KV
transfers, and every request's stream of tokens.

Disaggregated plan: a prompt runs in a prefill pool, whose worker samples the first token;
the request then waits (holding its prefill blocks) until a decode pool can take it, the
scheduler allocates decode blocks, and the prefill worker sends exactly those blocks to the
decode worker over UCX (gRPC carries only the descriptors). Once received, the prefill
blocks are freed and the request joins the decode pool's running batch. A worker with role
`both` keeps a request from prompt to finish with no transfer.
"""

from __future__ import annotations

import asyncio
import enum
import secrets
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from common.log import bind_request, get_logger
from services.scheduler.pool_scheduler import PoolScheduler, PoolStepPlan
from services.scheduler.request import FinishReason, Request
from services.scheduler.worker_client import (
    StepResult,
    WorkerClient,
    WorkerInfo,
    WorkerUnavailableError,
)

log = get_logger(__name__)


class InvalidRequestError(ValueError):
    """The request breaks a limit; the message names the field and the limit."""


class Stage(enum.Enum):
    PREFILL = "prefill"  # queued or running in a prefill-capable pool
    HANDOFF = "handoff"  # prompt done; holds prefill blocks until a decode pool has room
    TRANSFER = "transfer"  # KV moving over UCX; holds blocks in both pools
    DECODE = "decode"  # in a decode pool
    DONE = "done"


@dataclass(frozen=True)
class Finished:
    """The last event of a request's stream."""

    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # Set when the request failed: (status name, message), e.g. ("UNAVAILABLE", "...").
    error: tuple[str, str] | None = None


@dataclass(eq=False)
class Pool:
    info: WorkerInfo
    client: WorkerClient
    scheduler: PoolScheduler
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    healthy: bool = True

    @property
    def runs_prompts(self) -> bool:
        return self.info.role in ("prefill", "both")


@dataclass(eq=False)
class RequestHandle:
    request: Request
    pool: Pool
    stage: Stage = Stage.PREFILL
    # Token lists, then one Finished.
    events: asyncio.Queue = field(default_factory=asyncio.Queue)

    @property
    def done(self) -> bool:
        return self.stage is Stage.DONE


class Engine:
    def __init__(
        self,
        pools: Sequence[Pool],
        max_model_len: int,
        vocab_size: int,
        kv_transfer_timeout_s: float = 60.0,
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
        self.kv_transfer_timeout_s = kv_transfer_timeout_s
        self._handles: dict[str, RequestHandle] = {}
        self._handoffs: deque[RequestHandle] = deque()
        self._tasks: set[asyncio.Task] = set()
        self._tag_base = secrets.randbits(31) << 32
        self._tag_counter = 0

    # -- public --------------------------------------------------------------------------
    def start(self) -> None:
        for pool in self.pools:
            self._spawn(self._run_pool(pool), name=f"pool-{pool.info.worker_id}")

    def submit(self, request: Request) -> RequestHandle:
        """Validate and queue a request; raises InvalidRequestError naming field and limit."""
        self._validate(request)
        pool = self._pick_prefill_pool()
        if pool is None:
            raise WorkerUnavailableError("no healthy worker can run prompts")
        handle = RequestHandle(request=request, pool=pool)
        self._handles[request.request_id] = handle
        pool.scheduler.add(request)
        pool.wakeup.set()
        return handle

    def abort(self, request_id: str) -> bool:
        handle = self._handles.get(request_id)
        if handle is None:
            return False
        self._finish(handle, FinishReason.ABORT)
        return True

    @property
    def num_requests(self) -> int:
        return len(self._handles)

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

    def _pick_prefill_pool(self) -> Pool | None:
        candidates = [p for p in self.pools if p.healthy and p.runs_prompts]
        return min(
            candidates,
            key=lambda p: (p.scheduler.num_queued_tokens, -p.scheduler.blocks.num_free_blocks),
            default=None,
        )

    def _pick_decode_pool(self) -> Pool | None:
        candidates = [p for p in self.pools if p.healthy and p.info.role == "decode"]
        return max(candidates, key=lambda p: p.scheduler.blocks.num_free_blocks, default=None)

    # -- the step loop ------------------------------------------------------------------------
    async def _run_pool(self, pool: Pool) -> None:
        while True:
            try:
                await self._step_pool(pool)
            except WorkerUnavailableError as exc:
                self._fail_pool(pool, exc)
                return
            except Exception as exc:  # a bug must fail requests, not stop the service
                log.exception("step_failed", worker_id=pool.info.worker_id)
                for handle in [h for h in self._handles.values() if h.pool is pool]:
                    self._finish(handle, FinishReason.ABORT, ("INTERNAL", f"step failed: {exc}"))
                await asyncio.sleep(0.1)

    async def _step_pool(self, pool: Pool) -> None:
        """Plan one step for the pool, run it on the worker, apply its tokens."""
        pool.wakeup.clear()
        plan = pool.scheduler.schedule()
        for victim in plan.preempted:
            self._requeue(self._handles[victim.request_id])
        if plan.is_empty:
            await asyncio.sleep(0)  # never starve other tasks, even if woken already
            await pool.wakeup.wait()
            return
        result = await pool.client.step(plan)
        self._apply(pool, plan, result)

    def _apply(self, pool: Pool, plan: PoolStepPlan, result: StepResult) -> None:
        for request_id, token in result.sampled.items():
            handle = self._handles.get(request_id)
            if (
                handle is None
                or handle.pool is not pool
                or handle.stage not in (Stage.PREFILL, Stage.DECODE)
            ):
                continue  # finished or aborted while the step ran
            reason = handle.request.append_token(token)
            handle.events.put_nowait([token])
            if reason is not None:
                self._finish(handle, reason)
            elif pool.info.role == "prefill":
                pool.scheduler.detach(handle.request)
                handle.stage = Stage.HANDOFF
                self._handoffs.append(handle)
        if self._handoffs:
            self._start_handoffs()

    def _requeue(self, handle: RequestHandle) -> None:
        """A preempted request recomputes from its prompt + tokens so far in a prefill pool."""
        target = self._pick_prefill_pool()
        if target is None:
            self._finish(handle, FinishReason.ABORT, ("UNAVAILABLE", "no prefill worker left"))
            return
        handle.stage, handle.pool = Stage.PREFILL, target
        target.scheduler.add(handle.request, front=True)
        target.wakeup.set()

    # -- handoff and KV transfer -----------------------------------------------------------------
    def _start_handoffs(self) -> None:
        while self._handoffs:
            handle = self._handoffs[0]
            request = handle.request
            dst = self._pick_decode_pool()
            if dst is None:
                for stranded in list(self._handoffs):
                    self._finish(
                        stranded, FinishReason.ABORT, ("UNAVAILABLE", "no decode worker left")
                    )
                return
            # Room for the received KV plus one block of headroom for the next token.
            if not dst.scheduler.blocks.can_allocate(
                request.request_id, request.num_computed_tokens, reserve=1
            ):
                return
            self._handoffs.popleft()
            dst_blocks = dst.scheduler.blocks.allocate(
                request.request_id, request.num_computed_tokens
            )
            src_blocks = handle.pool.scheduler.blocks.table(request.request_id)[: len(dst_blocks)]
            handle.stage = Stage.TRANSFER
            self._spawn(
                self._transfer(handle, handle.pool, dst, src_blocks, dst_blocks),
                name=f"kv-{request.request_id}",
            )

    async def _transfer(
        self,
        handle: RequestHandle,
        src: Pool,
        dst: Pool,
        src_blocks: list[int],
        dst_blocks: list[int],
    ) -> None:
        request_id = handle.request.request_id
        self._tag_counter += 1
        tag = self._tag_base | self._tag_counter
        started = time.perf_counter()
        received, sent = await asyncio.gather(
            dst.client.receive_kv(tag, dst_blocks, self.kv_transfer_timeout_s),
            src.client.send_kv(tag, dst.info, src_blocks, self.kv_transfer_timeout_s),
            return_exceptions=True,
        )
        src.scheduler.blocks.free(request_id)
        src.wakeup.set()
        error = next((r for r in (received, sent) if isinstance(r, BaseException)), None)
        if handle.done or error is not None:
            dst.scheduler.blocks.free(request_id)
            if error is not None and not handle.done:
                handle.stage = Stage.DONE  # blocks are already freed above
                self._emit_finish(
                    handle, FinishReason.ABORT, ("UNAVAILABLE", f"KV transfer failed: {error}")
                )
            self._start_handoffs()
            return
        with bind_request(request_id):
            log.debug(
                "kv_transferred",
                src=src.info.worker_id,
                dst=dst.info.worker_id,
                blocks=len(dst_blocks),
                bytes=received.num_bytes,
                seconds=round(time.perf_counter() - started, 5),
            )
        handle.stage, handle.pool = Stage.DECODE, dst
        dst.scheduler.add(handle.request)
        dst.wakeup.set()
        self._start_handoffs()

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
            self._handoffs.remove(handle)
            handle.pool.scheduler.blocks.free(request.request_id)
            handle.pool.wakeup.set()
        # Stage.TRANSFER: the transfer task frees both sides when it returns.
        self._emit_finish(handle, reason, error)
        if stage is Stage.DECODE and self._handoffs:
            self._start_handoffs()  # decode blocks were freed

    def _emit_finish(
        self, handle: RequestHandle, reason: FinishReason, error: tuple[str, str] | None
    ) -> None:
        request = handle.request
        if request.finish_reason is None:
            request.finish_reason = reason
        self._handles.pop(request.request_id, None)
        handle.events.put_nowait(
            Finished(
                reason=request.finish_reason,
                prompt_tokens=len(request.prompt_token_ids),
                completion_tokens=len(request.output_token_ids),
                cached_tokens=request.num_cached_tokens,
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
                cached_tokens=request.num_cached_tokens,
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
