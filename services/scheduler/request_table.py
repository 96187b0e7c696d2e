"""Every request the engine runs, by id, and the one way each leaves a place or ends.

`release` frees what a request holds wherever it is (its pool's queues and blocks, a
hand-off waiting or a transfer in flight, a parked request's blocks); `finish` releases
and ends its stream with a `Finished` event; `requeue` sends a preempted request back to a
prefill pool to recompute; `lose` ends one that does not start over (its driver decides);
`fail_alone` ends one whose own bookkeeping hit a bug, leaving its neighbours alone. The
engine and `Recovery` both act through it; it calls back into neither.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from common.log import bind_request, get_logger
from services.scheduler.finish_log import log_finished
from services.scheduler.handle import Finished, RequestHandle, Stage
from services.scheduler.handoff import KvHandoff
from services.scheduler.pool import Pool, pick_prefill_pool
from services.scheduler.request import FinishReason, Request

log = get_logger(__name__)


class RequestTable:
    def __init__(self, pools: list[Pool], handoff: KvHandoff) -> None:
        self.pools = pools
        self.handoff = handoff
        self.handles: dict[str, RequestHandle] = {}
        # Called with each finished request and the time (metrics: RequestTimes.observe).
        self.on_finish: Callable[[Request, float], None] | None = None

    def __len__(self) -> int:
        return len(self.handles)

    def __iter__(self) -> Iterator[RequestHandle]:
        return iter(list(self.handles.values()))

    def add(self, handle: RequestHandle) -> None:
        self.handles[handle.request.request_id] = handle

    def get(self, request_id: str) -> RequestHandle | None:
        return self.handles.get(request_id)

    def of(self, request: Request) -> RequestHandle | None:
        """The request's handle while it runs; None once it ended (a handle that now
        holds the same id belongs to a later request)."""
        handle = self.handles.get(request.request_id)
        return handle if handle is not None and handle.request is request else None

    # -- leaving a place ---------------------------------------------------------------------
    def release(self, handle: RequestHandle) -> None:
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

    def requeue(self, handle: RequestHandle) -> None:
        """A preempted request recomputes from its prompt + tokens so far in a prefill pool."""
        target = pick_prefill_pool(self.pools, handle.request, allow_draining=True)
        if target is None:
            self.finish(handle, FinishReason.ABORT, ("UNAVAILABLE", "no prefill worker left"))
            return
        handle.queue_prompt(target)
        target.scheduler.add(handle.request, front=True)
        target.wakeup.set()

    def park(self, handle: RequestHandle) -> None:
        """A request that keeps its KV finished (`Request.keep_kv`): parked where it
        decodes; one that finished in a pool that does not decode hands its KV on to a
        decode pool first and parks where it arrives (the hand-off's `Parked` event)."""
        if handle.pool.scheduler.runs_decodes:
            handle.park()
            self.emit_finish(handle, handle.request.finish_reason, None, parked=True)
        else:
            self.handoff.enqueue(handle)

    def release_kv(self, request_id: str) -> None:
        """Free what a parked request keeps (nothing if it is not parked)."""
        handle = self.handles.get(request_id)
        if handle is not None and handle.stage is Stage.PARKED:
            self.release(handle)
            handle.finish()
            self.handles.pop(request_id, None)

    # -- ending ------------------------------------------------------------------------------
    def finish(
        self, handle: RequestHandle, reason: FinishReason, error: tuple[str, str] | None = None
    ) -> None:
        """Release whatever the request holds and end its stream."""
        if handle.done:
            return
        self.release(handle)
        handle.finish()
        self.emit_finish(handle, reason, error)

    def lose(self, handle: RequestHandle | None, why: str) -> None:
        """A request that does not start over (`Request.restartable`) lost its KV: it ends
        with ABORTED, and its driver decides what follows."""
        if handle is not None:
            self.finish(handle, FinishReason.ABORT, ("ABORTED", f"its KV was lost: {why}"))

    def fail_alone(self, request: Request, exc: Exception) -> None:
        """A bug met in one request's bookkeeping: that request ends with INTERNAL; the
        pool and the other requests go on."""
        with bind_request(request.request_id, request.trace_id):
            log.error("request_failed", error=repr(exc), exc_info=exc)
        handle = self.of(request)
        if handle is None:
            return
        error = ("INTERNAL", f"request failed: {exc!r}")
        try:
            self.finish(handle, FinishReason.ABORT, error)
        except Exception:  # its release failed too: end its stream all the same
            log.exception("request_release_failed", request_id=request.request_id)
            if not handle.done:
                handle.stage = Stage.DONE
                self.emit_finish(handle, FinishReason.ABORT, error)

    def emit_finish(
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
            self.handles.pop(request.request_id, None)
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
