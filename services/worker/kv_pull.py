"""Receiving KV by copying it out of a same-host peer's shared pool (`kv_shared`).

A pull waits until the steps before its plan have run here (steps planned before its blocks
were allocated may still write into them), then copies the source blocks' layers into its
own as the peer reports them final (in copies of at least `min_streamed_copy_bytes`, or all
at the end). Copies run on the tensor thread, ordered with this worker's steps, each first
checking the transfer was not cancelled. A pull fails (`KvTransferError`) when the peer
exits before the blocks are final (its pidfd turns readable), when its progress stalls for
`timeout_s`, or when it is cancelled. A peer's mappings are dropped when it exits or comes
back as another process.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence

from common.kv_groups import KvGroups
from common.kv_shared_memory import SharedMemoryInfo
from common.log import get_logger
from common.parallel_plan import Layout
from common.step_plan import KvSource
from common.step_result import KvLoadDone
from services.worker.kv_cache import KvCache, block_runs
from services.worker.kv_shared import PeerPool
from services.worker.kv_transfer import KvTransferCancelled, KvTransferError
from services.worker.parallel.kv_ranks import KvGeometry, RankPools

log = get_logger(__name__)

# Ready layers wait for more while fewer bytes than this: a small transfer is one copy.
MIN_STREAMED_COPY_BYTES = 2 << 20
MIN_SLEEP_S = 0.0005  # the poll schedule of `Peer`
BACKOFF_MAX_S = 0.004
MAX_SLEEP_S = 0.05


class KvMapError(KvTransferError):
    """The peer's shared pool cannot be mapped from here (another user, a forged or stale
    description): KV from that peer must come another way."""


class Peer:
    """A same-host peer's rank pools, mapped once, and one poll loop for every pull waiting
    on its progress (rank 0's header speaks for all its ranks).

    A pull waiting for the peer's next layer awaits `changed()`, which one task resolves
    when the progress word moves or the peer exits. It polls on a schedule learnt from the
    peer's pace: after a change it sleeps until shortly before the next is due (80% of the
    last interval, at most `MAX_SLEEP_S`), then looks every `MIN_SLEEP_S`, backing off to
    `BACKOFF_MAX_S` if the change is late: a few polls per 300 ms layer, and the last layer
    seen within about half a millisecond. Nobody waiting, the task ends."""

    def __init__(self, infos: tuple[SharedMemoryInfo, ...]) -> None:
        self.infos = infos
        self.ranks: list[PeerPool] = []
        self._changed = asyncio.Event()
        self._waiting = 0
        self._task: asyncio.Task | None = None
        self._last_change = time.monotonic()
        self._pace = 0.0  # the last interval between two changes (0: unknown)

    async def changed(self) -> None:
        """Return when the progress moved or the peer exited (or after a second)."""
        event = self._changed
        self._waiting += 1
        try:
            if self._task is None or self._task.done():
                self._task = asyncio.ensure_future(self._poll())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), 1.0)
        finally:
            self._waiting -= 1

    async def _poll(self) -> None:
        head = self.ranks[0]
        seen, sleep_s = head.progress(), MIN_SLEEP_S
        while self._waiting:
            due = self._last_change + 0.8 * self._pace - time.monotonic()
            await asyncio.sleep(min(MAX_SLEEP_S, due) if due > sleep_s else sleep_s)
            now, progress = time.monotonic(), head.progress()
            if progress != seen or not head.alive():
                if progress != seen:
                    self._pace, self._last_change = now - self._last_change, now
                seen, sleep_s = progress, MIN_SLEEP_S
                event, self._changed = self._changed, asyncio.Event()
                event.set()
            else:
                sleep_s = min(2 * sleep_s, BACKOFF_MAX_S)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for pool in self.ranks:
            pool.close()


class KvPuller:
    def __init__(
        self,
        kv_cache: KvCache,
        on_tensor_thread: Callable[..., Awaitable],
        is_cancelled: Callable[[int], bool],
        timeout_s: float,
        min_streamed_copy_bytes: int = MIN_STREAMED_COPY_BYTES,
        ranks: RankPools | None = None,
        groups: KvGroups | None = None,
    ) -> None:
        """`ranks`: this worker's rank pools when it is parallel (None: its one pool,
        `kv_cache`, holds every KV head of every layer); `groups`: the model's KV groups."""
        self.kv_cache, self.timeout_s = kv_cache, timeout_s
        self.min_streamed_copy_bytes = min_streamed_copy_bytes
        self._on_tensor_thread, self._is_cancelled = on_tensor_thread, is_cancelled
        if ranks is None:
            c = kv_cache
            geometry = KvGeometry(c.num_kv_heads, c.num_kv_heads, len(c.layer_slots),
                                  c.block_size, c.head_dim, groups)  # fmt: skip
            ranks = RankPools(geometry, Layout(), [c.data])
        self._pools = ranks
        self._peers: dict[str, Peer] = {}  # by worker id

    def peer(self, worker_id: str, *infos: SharedMemoryInfo, layout: Layout | None = None) -> Peer:
        """The peer's rank pools (`infos`: rank 0's first), mapped once (again if the peer
        came back as another process)."""
        peer = self._peers.get(worker_id)
        if peer is not None and peer.infos == infos:
            return peer
        self.forget(worker_id)
        peer = Peer(infos)
        try:
            for rank, info in enumerate(infos):
                shape = self._pools.geometry.block_shape(layout or Layout(), rank)
                peer.ranks.append(PeerPool(info, shape, self.kv_cache.dtype))
        except (OSError, ValueError) as exc:
            peer.close()
            raise KvMapError(f"cannot map the shared pool of {worker_id}: {exc}") from exc
        self._peers[worker_id] = peer
        mib = sum(info.num_bytes for info in infos) >> 20
        log.info("kv_peer_mapped", peer=worker_id, ranks=len(infos), pid=infos[0].pid, mib=mib)
        return peer

    def forget(self, worker_id: str) -> None:
        if (peer := self._peers.pop(worker_id, None)) is not None:
            peer.close()

    async def pull(
        self,
        tag: int,
        source: KvSource,
        block_ids: Sequence[int],
        wait_for_step: Callable[[], Awaitable[None]],
    ) -> KvLoadDone:
        """The blocks copied here; the outcome's lag runs from the peer's last layer done to
        now (0: not streamed)."""
        started = time.perf_counter()
        if len(source.block_ids) != len(block_ids):
            raise KvTransferError(
                f"{len(source.block_ids)} source blocks for {len(block_ids)} destination blocks"
            )
        layout = source.layout
        if len(source.rank_pools) != layout.world_size:
            raise KvTransferError(
                f"{source.worker_id} has {layout.world_size} ranks but "
                f"{len(source.rank_pools)} shared pools"
            )
        peer = self.peer(source.worker_id, *source.rank_pools, layout=layout)
        head = peer.ranks[0]
        bad = [b for b in source.block_ids if not 0 <= b < len(head.data)]
        if bad:
            raise KvTransferError(f"source block ids {bad[:4]} outside the peer's pool")
        await wait_for_step()
        runs = block_runs(source.block_ids, block_ids)
        geometry, pp = self._pools.geometry, self._pools.layout.pp
        num_layers = geometry.num_layers  # the model's
        # Along the pools' layer axis (layers, or KV groups' slots: `KvGeometry`).
        axis_end, copied = geometry.axis_done(num_layers, pp), 0
        nbytes = len(block_ids) * self.kv_cache.block_bytes
        layer_bytes = nbytes // self.kv_cache.num_layers
        stalled_since = time.monotonic()
        while copied < axis_end:
            ready = geometry.axis_done(head.layers_ready(source.ready_step_id, num_layers), pp)
            worth = (ready - copied) * layer_bytes >= self.min_streamed_copy_bytes
            if ready == axis_end or (ready > copied and worth):
                sources = [r.data for r in peer.ranks]
                await self._on_tensor_thread(self._copy, tag, layout, sources, runs, copied, ready)
                copied, stalled_since = ready, time.monotonic()
                continue
            if not head.alive():
                self.forget(source.worker_id)
                raise KvTransferError(f"{source.worker_id} exited before its KV was final")
            if time.monotonic() - stalled_since > self.timeout_s:
                raise KvTransferError(
                    f"{source.worker_id} made no progress on step {source.ready_step_id} "
                    f"for {self.timeout_s}s"
                )
            if self._is_cancelled(tag):
                raise KvTransferCancelled(f"transfer {tag:#x} was cancelled")
            await peer.changed()
        lag = 0.0
        if source.ready_step_id and (done_ns := head.done_ns(source.ready_step_id)) is not None:
            lag = max(0.0, (time.monotonic_ns() - done_ns) / 1e9)
            log.debug("kv_pulled", tag=tag, blocks=len(block_ids), source_lag_ms=lag * 1e3)
        if not head.alive():  # its memory stays mapped until we let go: the copy is whole
            self.forget(source.worker_id)
        return KvLoadDone(tag, nbytes, time.perf_counter() - started, lag)

    def _copy(self, tag: int, src: Layout, sources, runs, first_layer: int, end_layer: int):
        """On the tensor thread: a cancel seen here comes before any step that reuses the
        blocks (the scheduler sends the tag with the step that frees them). Each of this
        worker's ranks gets its KV heads from the source ranks that hold them."""
        if self._is_cancelled(tag):
            raise KvTransferCancelled(f"transfer {tag:#x} was cancelled")
        self._pools.copy(src, sources, runs, first_layer, end_layer)

    def close(self) -> None:
        for peer in self._peers.values():
            peer.close()
        self._peers.clear()
