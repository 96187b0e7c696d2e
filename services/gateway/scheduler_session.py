"""The gateway's one stream to the scheduler (`SchedulerService.Session`), shared by every
request: submits and aborts go out on it; the scheduler's batched updates come back and are
handed to each request's `RequestUpdates` by request id.

The stream opens on the first submit and again after it breaks (the scheduler restarted):
a break ends every open request with its status (UNAVAILABLE when the scheduler went
away), as the per-request streams did before. Writes are serialised (gRPC allows one at a
time); reading never waits on a slow consumer (each request's queue holds at most its own
updates).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import structlog

from common.log import get_logger
from common.pb.tandem.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from common.pb.tandem.v1 import generate_pb2

log = get_logger(__name__)
_END = object()


class SchedulerError(Exception):
    """The scheduler refused or failed a request: a gRPC status and its message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


def _status(name: str) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, name, grpc.StatusCode.UNKNOWN)


class RequestUpdates:
    """One request's updates, as an async iterator of `SubmitResponse`s; raises
    `SchedulerError` when the request fails. `close()` aborts it if it still runs."""

    def __init__(self, session: SchedulerSession, request_id: str, num_samples: int) -> None:
        self._session = session
        self.request_id = request_id
        self._unfinished = num_samples
        self._queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    def _deliver(self, update: scheduler_pb2.SubmitResponse) -> None:
        if update.error_code:
            self._fail(SchedulerError(_status(update.error_code), update.error_message))
            return
        self._queue.put_nowait(update)
        if update.finish_reason != generate_pb2.FINISH_REASON_UNSPECIFIED:
            self._unfinished -= 1
            if not self._unfinished:
                self._end()

    def _fail(self, error: SchedulerError) -> None:
        self._queue.put_nowait(error)
        self._end()

    def _end(self) -> None:
        self.finished = True
        self._queue.put_nowait(_END)
        self._session._forget(self.request_id)

    def __aiter__(self):
        return self

    async def __anext__(self) -> scheduler_pb2.SubmitResponse:
        item = await self._queue.get()
        if item is _END:
            self._queue.put_nowait(_END)  # stays ended
            raise StopAsyncIteration
        if isinstance(item, SchedulerError):
            raise item
        return item

    async def abort(self, index: int | None = None) -> None:
        """Stop the request, or only its sample `index` (e.g. it matched a stop string)."""
        request = scheduler_pb2.AbortRequest(request_id=self.request_id)
        if index is not None:
            request.index = index
        await self._session._write(scheduler_pb2.SessionRequest(abort=request))

    def close(self) -> None:
        """Abort the request if it still runs (the client went away); never waits."""
        if not self.finished:
            self.finished = True
            self._session._forget(self.request_id)
            self._session.abort_soon(self.request_id)


class SchedulerSession:
    def __init__(
        self,
        stub: scheduler_pb2_grpc.SchedulerServiceStub,
        on_broken: Callable[[SchedulerError], None] | None = None,
        address: str = "",
    ) -> None:
        self._stub = stub
        self._address = address  # for the log
        self._on_broken = on_broken  # told when the stream fails (a multi-scheduler gateway)
        self._call = None
        self._reader: asyncio.Task | None = None
        self._open: dict[str, RequestUpdates] = {}
        self._write_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()

    @property
    def num_open(self) -> int:
        return len(self._open)

    async def submit(self, request: scheduler_pb2.SubmitRequest) -> RequestUpdates:
        """Send a request; its updates come through the returned iterator."""
        updates = RequestUpdates(self, request.request_id, max(1, request.n))
        self._open[request.request_id] = updates
        try:
            await self._write(scheduler_pb2.SessionRequest(submit=request))
        except BaseException:  # cancelled while written: abort whatever reached it
            updates.close()
            raise
        return updates

    def abort_soon(self, request_id: str) -> None:
        abort = scheduler_pb2.AbortRequest(request_id=request_id)
        task = asyncio.get_running_loop().create_task(
            self._write_now(scheduler_pb2.SessionRequest(abort=abort), quiet=True)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _write(self, message: scheduler_pb2.SessionRequest, quiet: bool = False) -> None:
        """Write on the shared stream. Shielded: gRPC cancels the whole call when a write is
        cancelled, so a caller cancelled meanwhile (its client went away) must not take
        the write with it, or every request on the session would fail."""
        write = asyncio.get_running_loop().create_task(self._write_now(message, quiet))
        self._tasks.add(write)
        write.add_done_callback(self._tasks.discard)
        await asyncio.shield(write)

    async def _write_now(self, message: scheduler_pb2.SessionRequest, quiet: bool) -> None:
        async with self._write_lock:
            call = self._ensure_open()
            try:
                await call.write(message)
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as exc:
                if quiet:
                    return
                self._broken(call, _error_of(exc))

    def _ensure_open(self):
        if self._call is None:
            self._call = self._stub.Session()
            self._reader = asyncio.get_running_loop().create_task(self._read(self._call))
        return self._call

    async def _read(self, call) -> None:
        # The task was started inside the first submit's request context; it serves all.
        structlog.contextvars.unbind_contextvars("request_id")
        try:
            async for response in call:
                for update in response.updates:
                    updates = self._open.get(update.request_id)
                    if updates is not None:
                        updates._deliver(update)
            error = SchedulerError(grpc.StatusCode.UNAVAILABLE, "the scheduler closed the session")
        except grpc.aio.AioRpcError as exc:
            error = _error_of(exc)
        except asyncio.CancelledError:
            error = SchedulerError(grpc.StatusCode.UNAVAILABLE, "the gateway is shutting down")
        self._broken(call, error)

    def _broken(self, call, error: SchedulerError) -> None:
        """The stream failed: every request still open on it fails with `error`; the next
        submit opens a new stream."""
        if self._call is not call:
            return
        self._call = None
        call.cancel()
        log.warning(
            "scheduler_session_broken",
            scheduler=self._address,
            code=error.code.name,
            details=error.details,
        )
        if self._on_broken is not None:
            self._on_broken(error)
        for updates in list(self._open.values()):
            updates._fail(error)

    def _forget(self, request_id: str) -> None:
        self._open.pop(request_id, None)

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
        if self._reader is not None:
            self._reader.cancel()


def _error_of(exc: Exception) -> SchedulerError:
    if isinstance(exc, grpc.aio.AioRpcError):
        return SchedulerError(exc.code(), exc.details() or "scheduler error")
    return SchedulerError(grpc.StatusCode.UNAVAILABLE, f"scheduler session failed: {exc!r}")
