"""Receiving KV by copying it out of a same-host peer's shared pool (see `kv_shared`).

The receive waits until the steps before its plan have run here (`after_step_id`: steps
planned before its blocks were allocated may still write into them), then copies the layers
of the source blocks into its own blocks as the peer reports them final: the layers the
peer has finished go in one copy, the rest follow as it finishes them (in copies of at
least 2 MiB, or all at the end for a small transfer;
the waiting is `kv_progress_watch`'s, one poll loop per peer). Copies run on the tensor
thread, so they are ordered with this worker's steps, and each first checks the transfer
was not cancelled.

A transfer fails (`KvTransferError`) when the peer exits before the blocks are final
(its pidfd turns readable), when the peer's progress stalls for `timeout_s`, or when it
is cancelled. Mappings are cached per peer and dropped when the peer changes or exits.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from common.kv_groups import KvGroups
from common.kv_shared_memory import SharedMemoryInfo
from common.log import get_logger
from common.parallel_plan import Layout
from common.step_plan import KvSource
from services.worker.kv_cache import KvCache
from services.worker.kv_progress_watch import ProgressWatch
from services.worker.kv_shared import PeerPool, block_runs
from services.worker.kv_transfer import KvTransferCancelled, KvTransferError
from services.worker.parallel.kv_ranks import RankPools

log = get_logger(__name__)


class KvMapError(KvTransferError):
    """The peer's shared pool cannot be mapped from here (another user, a forged or stale
    description): KV from that peer must come another way."""


# Layers ready but not yet copied are left for later while they are fewer bytes than
# this (and more layers are coming): a small transfer is one copy at the end, a large one
# is copied layer by layer.
MIN_STREAMED_COPY_BYTES = 2 << 20


@dataclass(frozen=True)
class PullResult:
    num_bytes: int
    seconds: float
    source_lag_seconds: float  # peer's last layer done -> blocks here (0: not streamed)


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
        self.kv_cache = kv_cache
        self.groups = groups
        self.ranks = ranks
        self.min_streamed_copy_bytes = min_streamed_copy_bytes
        self._on_tensor_thread = on_tensor_thread
        self._is_cancelled = is_cancelled
        self.timeout_s = timeout_s
        self._peers: dict[tuple[str, int], PeerPool] = {}  # (worker id, rank)
        self._watches: dict[str, ProgressWatch] = {}

    def _rank_pools(self) -> RankPools:
        if self.ranks is None:
            from services.worker.parallel.kv_ranks import KvGeometry

            c = self.kv_cache
            geometry = KvGeometry(c.num_kv_heads, c.num_kv_heads, len(c.layer_slots),
                                  c.block_size, c.head_dim, self.groups)  # fmt: skip
            self.ranks = RankPools(geometry, Layout(), [c.data])
        return self.ranks

    def peer(
        self, worker_id: str, info: SharedMemoryInfo, layout: Layout | None = None, rank: int = 0
    ):
        """Rank `rank`'s pool of the peer, mapped once (again if the peer came back as
        another process)."""
        key = (worker_id, rank)
        peer = self._peers.get(key)
        if peer is not None and peer.info == info:
            return peer
        if peer is not None:
            self.forget(worker_id)
        shape = self._rank_pools().geometry.block_shape(layout or Layout(), rank)
        try:
            peer = PeerPool(info, shape, self.kv_cache.dtype)
        except (OSError, ValueError) as exc:
            raise KvMapError(f"cannot map the shared pool of {worker_id}: {exc}") from exc
        self._peers[key] = peer
        if rank == 0:
            self._watches[worker_id] = ProgressWatch(peer.progress, peer.alive)
        log.info("kv_peer_mapped", peer=worker_id, rank=rank, pid=info.pid,
                 mib=info.num_bytes >> 20)  # fmt: skip
        return peer

    def forget(self, worker_id: str) -> None:
        for key in [k for k in self._peers if k[0] == worker_id]:
            self._peers.pop(key).close()
        watch = self._watches.pop(worker_id, None)
        if watch is not None:
            watch.close()

    async def pull(
        self,
        tag: int,
        source: KvSource,
        block_ids: Sequence[int],
        wait_for_step: Callable[[], Awaitable[None]],
    ) -> PullResult:
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
        # Rank 0 first: its watch exists before the loop below (a remap drops them all).
        ranks = [self.peer(source.worker_id, info, layout, r) for r, info in
                 enumerate(source.rank_pools)]  # fmt: skip
        peer = ranks[0]
        bad = [b for b in source.block_ids if not 0 <= b < peer.num_blocks]
        if bad:
            raise KvTransferError(f"source block ids {bad[:4]} outside the peer's pool")
        await wait_for_step()
        runs = block_runs(source.block_ids, block_ids)
        pools = self._rank_pools()
        geometry, pp = pools.geometry, pools.layout.pp
        num_layers = geometry.num_layers  # the model's
        # Along the pools' layer axis (layers, or KV groups' slots: `KvGeometry`).
        axis_end, copied = geometry.axis_done(num_layers, pp), 0
        layer_bytes = len(block_ids) * self.kv_cache.block_bytes // self.kv_cache.num_layers
        watch = self._watches[source.worker_id]
        stalled_since = time.monotonic()
        while copied < axis_end:
            ready = geometry.axis_done(peer.layers_ready(source.ready_step_id, num_layers), pp)
            worth = (ready - copied) * layer_bytes >= self.min_streamed_copy_bytes
            if ready == axis_end or (ready > copied and worth):
                sources = [r.data for r in ranks]
                await self._on_tensor_thread(self._copy, tag, layout, sources, runs, copied, ready)
                copied, stalled_since = ready, time.monotonic()
                continue
            if not peer.alive():
                self.forget(source.worker_id)
                raise KvTransferError(f"{source.worker_id} exited before its KV was final")
            if time.monotonic() - stalled_since > self.timeout_s:
                raise KvTransferError(
                    f"{source.worker_id} made no progress on step {source.ready_step_id} "
                    f"for {self.timeout_s}s"
                )
            if self._is_cancelled(tag):
                raise KvTransferCancelled(f"transfer {tag:#x} was cancelled")
            await watch.changed(timeout_s=1.0)
        lag = 0.0
        if source.ready_step_id:
            done_ns = peer.done_ns(source.ready_step_id)
            if done_ns is not None:
                lag = max(0.0, (time.monotonic_ns() - done_ns) / 1e9)
                log.debug("kv_pulled", tag=tag, blocks=len(block_ids), source_lag_ms=lag * 1e3)
        if not peer.alive():  # its memory stays mapped until we let go: the copy is whole
            self.forget(source.worker_id)
        nbytes = len(block_ids) * self.kv_cache.block_bytes
        return PullResult(nbytes, time.perf_counter() - started, lag)

    def _copy(self, tag: int, src: Layout, sources, runs, first_layer: int, end_layer: int):
        """On the tensor thread: a cancel seen here comes before any step that reuses the
        blocks (the scheduler sends the tag with the step that frees them). Each of this
        worker's ranks gets its KV heads from the source ranks that hold them."""
        if self._is_cancelled(tag):
            raise KvTransferCancelled(f"transfer {tag:#x} was cancelled")
        self._rank_pools().copy(src, sources, runs, first_layer, end_layer)

    def close(self) -> None:
        for worker_id in {key[0] for key in self._peers}:
            self.forget(worker_id)
