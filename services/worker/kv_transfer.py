"""KV block transfer between workers over UCX (`ucxx`), one tagged message per transfer.

Each worker owns one UCX worker; its address travels to peers in `DescribeWorker` (gRPC),
and senders create endpoints from it (shared memory on one host, the best transport UCX
finds across hosts). Only descriptors travel over gRPC; the bytes travel here.

A transfer is: the sender gathers its blocks (one contiguous region each, see kv_cache) into
one buffer and sends it with the transfer's tag; the receiver posts a tagged receive on its
UCX worker (no endpoint needed), then scatters the buffer into its destination blocks.
"""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np

from common.log import get_logger

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


# UCX's progress thread wakes at least this often (ms). ucxx's own 1 ms woke each worker
# ~870 times a second even when idle, preempting the model's OpenMP threads; on the
# TCP/RDMA transports that peer-failure handling uses, traffic wakes it through its event
# fd anyway. Shared memory (error handling off) keeps ucxx's 1 ms.
QUIET_EPOLL_TIMEOUT_MS = 100


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


class UcxTransport:
    """This process's UCX worker: its address, cached endpoints to peers, tagged send/recv."""

    def __init__(self, timeout_s: float = 60.0, error_handling: bool = True) -> None:
        """`error_handling` makes a dead peer fail only the transfers it was part of, but
        UCX then uses only transports that can detect peer failure (TCP, RDMA); off,
        same-host peers use shared memory (several times faster here), a dead receiver
        shows as a send timeout, and a sender that dies mid-transfer can make UCX abort
        the receiving process (seen in the fault tests)."""
        import ucxx  # imported here: loading UCX is slow and only workers need it

        if error_handling:
            _slow_idle_progress_thread(QUIET_EPOLL_TIMEOUT_MS)
        self._ucxx = ucxx
        self.timeout_s = timeout_s
        self.error_handling = error_handling
        self._endpoints: dict[tuple[str, bytes], object] = {}
        self._connect_lock = asyncio.Lock()

    @property
    def address(self) -> bytes:
        return bytes(self._ucxx.get_worker_address())

    async def send(self, peer_id: str, peer_address: bytes, tag: int, payload: np.ndarray) -> None:
        """Send a contiguous buffer to the peer's worker with `tag`; waits for completion."""
        key = (peer_id, peer_address)
        try:
            endpoint = await self._endpoint(key)
            await asyncio.wait_for(
                endpoint.send(payload, tag=tag, force_tag=True), timeout=self.timeout_s
            )
        except Exception as exc:  # any UCX failure leaves the endpoint unusable
            self._endpoints.pop(key, None)
            raise KvTransferError(f"send to {peer_id} (tag {tag:#x}) failed: {exc!r}") from exc

    async def receive(self, tag: int, nbytes: int, out: np.ndarray | None = None) -> np.ndarray:
        """Receive exactly nbytes tagged `tag` from any peer (into `out` when given)."""
        buffer = np.empty(nbytes, dtype=np.uint8) if out is None else out
        try:
            await asyncio.wait_for(self._ucxx.recv(buffer, tag=tag), timeout=self.timeout_s)
        except Exception as exc:
            raise KvTransferError(f"receive of tag {tag:#x} failed: {exc!r}") from exc
        return buffer

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

    async def close(self) -> None:
        for endpoint in self._endpoints.values():
            try:
                await endpoint.close()
            except Exception:  # closing a dead peer's endpoint may fail; nothing to do
                pass
        self._endpoints.clear()
        # Shut UCX down: its notifier thread is not a daemon (the process could not exit
        # while it runs) and serves the event loop it started on, so a later transport in
        # this process (on another loop) needs a fresh context.
        try:
            self._ucxx.reset()
        except Exception as exc:  # something still holds UCX: at least stop the thread
            log.warning("ucx_reset_failed", error=repr(exc)[:500])
            self._ucxx.stop_notifier_thread()
