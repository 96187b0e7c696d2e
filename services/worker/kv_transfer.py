"""This process's UCX worker (`ucxx`): tagged sends and receives of KV buffers between
workers. Its address travels to peers in `DescribeWorker`; senders create endpoints from it
(shared memory on one host, the best transport UCX finds across hosts). What a message
holds and how it is gathered and scattered is `kv_layout_transfer`'s; a GPU pool's buffers
are device memory, which UCX moves itself (`cuda_ipc` on one host, else `cuda_copy`, as the
endpoint's allowed transports decide: `ucx_info -d` lists them).

A send or receive whose caller gives up (cancelled, timed out) stays posted in UCX (ucxx
exposes no per-request cancel): its buffer stays referenced until UCX completes the
request. Freeing it early let a late message land in freed memory (a heap corruption, seen
when a client cancelled during a transfer). A send completes when the peer receives it or
fails. A receive is completed at once by a 1-byte message with its tag that this worker
sends itself (UCX completes a receive with a shorter message, without error); the real
message, if it still comes, then finds no receive and its sender times out (one already
arriving completes the receive instead, leaving the byte unmatched; tags are not reused).
`abandoned_bytes` shows what is still held.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass

import numpy as np

from common.log import get_logger
from services.worker import ucx_tuning  # noqa: F401  (UCX defaults, set before UCX loads)

log = get_logger(__name__)

# ucxx sets UCX_MEMTYPE_CACHE itself; UCX then warns it is unused on CPU-only builds.
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
# Completed requests wake their awaiting coroutine through a notifier thread. Without it,
# every pending send or receive polls with `asyncio.sleep(0)`: a receive posted before its
# sender is ready kept the worker's event loop at 100% CPU (and fighting the tensor thread
# for the GIL) for as long as it waited.
os.environ.setdefault("UCXPY_ENABLE_PYTHON_FUTURE", "1")


class KvTransferError(RuntimeError):
    """A transfer failed or timed out; the caller decides whether to retry or fail."""


class KvTransferCancelled(KvTransferError):
    """The scheduler gave the transfer up (its request ended, e.g. on its first token):
    not a failure."""


# UCX's progress thread wakes at least this often (ms). ucxx's own 1 ms woke each worker
# ~870 times a second even when idle, preempting the model's OpenMP threads; on the
# TCP/RDMA transports that peer-failure handling uses, traffic wakes it through its event
# fd anyway. Shared memory (error handling off) keeps ucxx's 1 ms.
QUIET_EPOLL_TIMEOUT_MS = 100
# Bound on the 1-byte message that completes an abandoned receive (microseconds normally).
SELF_SEND_TIMEOUT_S = 5.0
# How long aborting a failed endpoint may block (UCX waits up to twice this).
ABORT_PERIOD_NS = 200_000_000


def _slow_idle_progress_thread(epoll_timeout_ms: int) -> None:
    """Make ucxx's thread progress mode (created with this process's UCX context) wait up
    to `epoll_timeout_ms` for events instead of 1 ms."""
    import weakref

    from ucxx._lib_async import application_context, continuous_ucx_progress

    class QuietThreadMode(continuous_ucx_progress.ProgressTask):
        def __init__(self, worker, event_loop, polling_mode=False):
            super().__init__(worker, event_loop)
            worker.set_progress_thread_start_callback(continuous_ucx_progress._create_context)
            worker.start_progress_thread(polling_mode=polling_mode, epoll_timeout=epoll_timeout_ms)
            weakref.finalize(self, worker.stop_progress_thread)

    application_context.ThreadMode = QuietThreadMode


@dataclass(frozen=True)
class TransferDeadline:
    """How long one UCX send or receive may take before it fails: `base_s` plus its bytes
    at `min_bytes_per_s`, never more than `cap_s` (`--kv-transfer-timeout-s`). A link cut
    in the middle of a transfer gives UCX nothing to report (TCP keeps retransmitting), so
    the deadline is what notices it: ~5 s for a transfer of a few MiB by default, where a
    fixed 60 s held the request that long. A receive gets `base_s` twice: its sender may
    start a little later (its gather waits for the tensor thread). A slow link that still
    moves `min_bytes_per_s` finishes in time."""

    cap_s: float = 60.0
    base_s: float = 60.0
    min_bytes_per_s: float = 25e6

    @classmethod
    def from_config(cls, config) -> TransferDeadline:
        """From a worker's settings: `kv_transfer_timeout_s` (the cap),
        `kv_transfer_base_timeout_s`, `kv_transfer_min_rate_mb_s`."""
        return cls(
            cap_s=config.kv_transfer_timeout_s,
            base_s=min(config.kv_transfer_base_timeout_s, config.kv_transfer_timeout_s),
            min_bytes_per_s=config.kv_transfer_min_rate_mb_s * 1e6,
        )

    def send_s(self, nbytes: int) -> float:
        return min(self.cap_s, self.base_s + nbytes / self.min_bytes_per_s)

    def receive_s(self, nbytes: int) -> float:
        return min(self.cap_s, 2 * self.base_s + nbytes / self.min_bytes_per_s)


async def all_or_cancel(awaitables) -> list:
    """Await them all; the first failure cancels the others (a cancelled UCX receive lets
    go of its buffer safely, see `UcxTransport.receive`) and is raised."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class UcxTransport:
    """This process's UCX worker: its address, cached endpoints to peers, tagged send/recv."""

    def __init__(
        self,
        timeout_s: float = 60.0,
        error_handling: bool = True,
        deadline: TransferDeadline | None = None,
    ) -> None:
        """`error_handling` makes a dead peer fail only the transfers it was part of, but
        UCX then uses only transports that can detect peer failure (TCP, RDMA); off,
        same-host peers use shared memory (several times faster here), a dead receiver
        shows as a send timeout, and a sender that dies mid-transfer can make UCX abort
        the receiving process (seen in the fault tests). `deadline`: each send's and
        receive's, by its size (default: `timeout_s` whatever the size)."""
        import ucxx  # imported here: loading UCX is slow and only workers need it

        if error_handling:
            _slow_idle_progress_thread(QUIET_EPOLL_TIMEOUT_MS)
        self._ucxx = ucxx
        self.timeout_s = timeout_s
        self.deadline = deadline  # None: `timeout_s`, whatever the size
        self.error_handling = error_handling
        self._endpoints: dict[tuple[str, bytes], object] = {}
        self._connect_lock = asyncio.Lock()
        # (UCX request, buffer) of sends/receives given up on while UCX still held them.
        self._abandoned: list[tuple[object, object]] = []
        self._closed = False

    @property
    def address(self) -> bytes:
        return bytes(self._ucxx.get_worker_address())

    async def send(self, peer_id: str, peer_address: bytes, tag: int, payload) -> None:
        """Send a contiguous buffer to the peer's worker with `tag`; waits for completion.
        `payload`: a host array, or a device tensor (UCX's `cuda_ipc` / `cuda_copy`)."""
        key = (peer_id, peer_address)
        try:
            endpoint = await self._endpoint(key)
            endpoint._ep.raise_on_error()  # ucxx's Endpoint.send, keeping the request
            if endpoint.closed:
                raise RuntimeError("endpoint closed")
            await self._complete(
                endpoint._ep.tag_send(self._array(payload), self._tag(tag)),
                payload,
                self._deadline_s("send", payload.nbytes),
                (key, endpoint),
            )
        except Exception as exc:  # any UCX failure leaves the endpoint unusable
            self._drop_endpoint(key)
            raise KvTransferError(f"send to {peer_id} (tag {tag:#x}) failed: {exc!r}") from exc

    def _drop_endpoint(self, key: tuple[str, bytes], endpoint=None) -> None:
        """Forget a failed endpoint (`endpoint`: that one only, if it is still the cached
        one) and abort it: UCX then completes what is still posted on it (a send stuck
        behind a cut link, or whose receiver dropped its receive) with an error, so its
        buffer is let go instead of being held until the link heals, or for ever."""
        if endpoint is None:
            endpoint = self._endpoints.pop(key, None)
        elif self._endpoints.get(key) is endpoint:
            del self._endpoints[key]
        # Without peer-failure handling (shared memory) an abort cancels nothing: the send
        # stays held until received, as before.
        if endpoint is None or key[0] == "loopback" or not self.error_handling:
            return
        try:
            endpoint.abort(period=ABORT_PERIOD_NS)
        except Exception as exc:  # already closed by UCX: nothing is held
            log.debug("ucx_endpoint_abort_failed", peer=key[0], error=repr(exc)[:300])
        self.reap_abandoned()

    async def receive(self, tag: int, nbytes: int, out=None):
        """Receive exactly nbytes tagged `tag` from any peer (into `out` when given: a host
        array or a device tensor; a host array otherwise)."""
        buffer = np.empty(nbytes, dtype=np.uint8) if out is None else out
        try:
            worker = self._ucxx.core._get_ctx().worker  # ucxx.recv, keeping the request
            request = worker.tag_recv(self._array(buffer), self._tag(tag))
            try:
                await self._complete(request, buffer, self._deadline_s("receive", nbytes))
            except BaseException:
                if not request.completed:
                    await self._complete_abandoned_receive(tag)
                raise
        except Exception as exc:
            raise KvTransferError(f"receive of tag {tag:#x} failed: {exc!r}") from exc
        return buffer

    async def _complete_abandoned_receive(self, tag: int) -> None:
        """Send this worker a 1-byte message tagged `tag` (through a cached loopback
        endpoint), which completes the receive given up on so its buffer can be let go."""
        if self._closed:
            return
        try:
            await asyncio.wait_for(
                self.send("loopback", self.address, tag, np.zeros(1, dtype=np.uint8)),
                timeout=SELF_SEND_TIMEOUT_S,
            )
        except Exception as exc:  # the receive stays held, as before
            log.warning("ucx_abandoned_receive_not_completed", tag=tag, error=repr(exc)[:500])
        self.reap_abandoned()

    @staticmethod
    def _array(buffer):
        from ucxx._lib.arr import Array

        return Array(buffer)

    @staticmethod
    def _tag(tag: int):
        from ucxx.types import Tag

        return Tag(tag)

    def _deadline_s(self, kind: str, nbytes: int) -> float:
        if self.deadline is None:
            return self.timeout_s
        return self.deadline.send_s(nbytes) if kind == "send" else self.deadline.receive_s(nbytes)

    async def _complete(
        self, request, buffer, timeout_s: float | None = None, sent_on=None
    ) -> None:
        """Wait for a UCX request (up to `timeout_s`, default the transport's); if this wait
        ends first (timeout, cancel, error), keep `buffer` alive beside the request until
        UCX is done with it. `sent_on`: (key, endpoint) of a send: one given up on before
        its deadline (its caller was cancelled) whose receiver never takes it is cancelled
        at that deadline by aborting its endpoint."""
        timeout_s = timeout_s or self.timeout_s
        deadline = time.monotonic() + timeout_s
        try:
            await asyncio.wait_for(request.wait(), timeout=timeout_s)
        except BaseException:
            if not request.completed:
                self._abandoned.append((request, buffer))
                log.warning(
                    "ucx_request_abandoned",
                    held=len(self._abandoned),
                    held_bytes=self.abandoned_bytes,
                )
                if sent_on is not None:
                    delay = max(0.0, deadline - time.monotonic())
                    asyncio.get_running_loop().call_later(
                        delay, self._expire_send, request, *sent_on
                    )
            raise
        finally:
            self.reap_abandoned()

    def _expire_send(self, request, key: tuple[str, bytes], endpoint) -> None:
        """A send given up on is past its deadline: abort its endpoint if UCX still
        holds it (its receiver dropped the receive: it would be held for ever)."""
        if not request.completed and not self._closed:
            log.warning("ucx_send_expired", peer=key[0])
            self._drop_endpoint(key, endpoint)

    def reap_abandoned(self) -> int:
        """Let go of the buffers of abandoned requests UCX has completed; returns how many
        are still held."""
        self._abandoned = [(r, b) for r, b in self._abandoned if not r.completed]
        return len(self._abandoned)

    def held_bytes(self) -> int:
        """`abandoned_bytes` after letting go of what UCX has completed (the metric)."""
        self.reap_abandoned()
        return self.abandoned_bytes

    @property
    def abandoned_bytes(self) -> int:
        return sum(b.nbytes for _, b in self._abandoned)

    async def _endpoint(self, key: tuple[str, bytes]):
        async with self._connect_lock:
            endpoint = self._endpoints.get(key)
            if endpoint is None:
                started = time.perf_counter()
                address = self._ucxx.get_ucx_address_from_buffer(key[1])
                endpoint = await self._ucxx.create_endpoint_from_worker_address(
                    address, endpoint_error_handling=self.error_handling
                )
                self._endpoints[key] = endpoint
                log.info(
                    "ucx_endpoint_created",
                    peer=key[0],
                    seconds=round(time.perf_counter() - started, 4),
                )
            return endpoint

    async def _close_endpoints(self) -> None:
        endpoints = list(self._endpoints.values())
        self._endpoints.clear()
        for endpoint in endpoints:
            try:
                await endpoint.close()
            except Exception:  # closing a dead peer's endpoint may fail; nothing to do
                pass

    def _wake_notifier(self) -> None:
        ctx = self._ucxx.core._ctx
        if ctx is not None and ctx.notifier_thread is not None:
            try:
                ctx.worker.stop_request_notifier_thread()
            except Exception as exc:  # reset still stops it, only slower
                log.warning("ucx_notifier_wake_failed", error=repr(exc)[:500])

    async def close(self) -> None:
        self._closed = True
        await self._close_endpoints()
        # Shut UCX down: its notifier thread is not a daemon (the process could not exit
        # while it runs) and serves the event loop it started on, so a later transport in
        # this process (on another loop) needs a fresh context. That thread waits up to 1 s
        # for a completed request before it reads its shutdown message: wake it first, or
        # every worker's exit (and a test stack's stop) takes up to a second longer. Both
        # steps are helpers: `reset` refuses while any frame (this one's locals included)
        # still references the context or an endpoint.
        self._wake_notifier()
        try:
            self._ucxx.reset()
        except Exception as exc:  # something still holds UCX: at least stop the thread
            log.warning("ucx_reset_failed", error=repr(exc)[:500])
            self._ucxx.stop_notifier_thread()
