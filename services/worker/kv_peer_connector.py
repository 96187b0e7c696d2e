"""The peers' connector: KV between this worker and another, three ways, chosen per
transfer from what the scheduler's call says and what the two workers are.

- **The same-host pull** (`ReceiveKv` with a source, `kv_pull`): copied straight out of the
  peer's shared pool, layer by layer as it reports them written (a prefill worker reports
  them: `save_kv_layer`, with the step's start and end, in its pool's header).
- **UCX** (`SendKv` + `ReceiveKv` with one tag, `kv_transfer`): gathered into a staging
  buffer, sent, received into a staging buffer and scattered into the blocks once the
  steps planned before they were allocated have run (`after_step_id`).
- **UCX between workers of different layouts** (`kv_layout_transfer`): every rank sends
  and receives its own part.

A receive is never written into the pool after its transfer was cancelled: the scheduler's
cancels come with its next plan (`cancel`), and each copy or scatter checks first, on the
tensor thread, ordered with the steps.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from common.parallel_plan import Layout
from common.step_plan import BlockMoves
from services.worker.config import WorkerConfig
from services.worker.kv_cache import KvCache
from services.worker.kv_connector import KvConnector
from services.worker.kv_layout_transfer import LayoutTransfers
from services.worker.kv_pull import KvPuller, KvSource, PullResult
from services.worker.kv_shared import SharedPool
from services.worker.kv_transfer import (
    KvTransferCancelled,
    KvTransferError,
    TransferDeadline,
    UcxTransport,
)
from services.worker.parallel.kv_ranks import KvGeometry, RankPools
from services.worker.parallel.peer_ranks import PeerRanks
from services.worker.staging import StagingBuffers

ONE_PROCESS = Layout()
# Cancelled transfer tags remembered (a cancel may arrive before its receive does).
MAX_CANCELLED_TAGS = 65536


@dataclass(frozen=True)
class TransferResult:
    num_bytes: int
    seconds: float


class PeerKvConnector(KvConnector):
    def __init__(
        self,
        config: WorkerConfig,
        kv_cache: KvCache,
        geometry: KvGeometry,
        on_tensor_thread: Callable[..., Awaitable],
        copy_on_tensor_thread: Callable[..., Awaitable],
        wait_for_step: Callable[[int], Awaitable],
        progress: SharedPool | None = None,
        peers: PeerRanks | None = None,
        rank_pools: RankPools | None = None,
    ) -> None:
        """`progress`: this worker's shared pool when peers stream its prompts' KV while
        they compute (a prefill worker). `rank_pools`: every rank's pool, for a parallel
        worker's pulls. `wait_for_step(n)` returns once step n has run here."""
        self.kv_cache, self.layout, self.peers = kv_cache, config.layout, peers
        self._on_tensor_thread, self._wait_for_step = on_tensor_thread, wait_for_step
        self._progress, self._running_step_id = progress, 0
        self.saves_layers = progress is not None
        self.transport = UcxTransport(
            timeout_s=config.kv_transfer_timeout_s,
            error_handling=config.kv_transfer_error_handling,
            deadline=TransferDeadline.from_config(config),
        )
        self.staging = StagingBuffers(device=kv_cache.device)
        self._cancelled: OrderedDict[int, None] = OrderedDict()
        self._receives: dict[int, asyncio.Task] = {}
        self.puller = KvPuller(
            kv_cache, copy_on_tensor_thread, self.is_cancelled, config.kv_transfer_timeout_s,
            config.kv_transfer_stream_min_copy_bytes, rank_pools, geometry.groups,
        )  # fmt: skip
        self.layouts = LayoutTransfers(
            geometry, self.layout, kv_cache.data, self.transport, peers, on_tensor_thread
        )

    # The connector points: a prefill worker's progress, read by the peers pulling from it.
    def start_load_kv(self, moves: BlockMoves, step_id: int) -> None:
        if self._progress is not None:
            self._running_step_id = step_id
            self._progress.step_started(step_id)

    def save_kv_layer(self, layer: int) -> None:
        self._progress.layer_done(self._running_step_id, layer)

    def wait_for_save(self, moves: BlockMoves, step_id: int) -> None:
        if self._progress is not None:
            self._progress.step_done(step_id)

    def reset(self) -> None:
        if self._progress is not None:
            self._progress.reset()

    @property
    def receiving(self) -> bool:
        return bool(self._receives)

    def is_cancelled(self, tag: int) -> bool:
        return tag in self._cancelled

    def cancel(self, tags: Iterable[int]) -> None:
        """The scheduler gave up on these receives: none of them may write into the pool
        from now on (their blocks may already belong to another request)."""
        for tag in tags:
            self._cancelled[tag] = None
            self._cancelled.move_to_end(tag)
            task = self._receives.get(tag)
            if task is not None:
                task.cancel()
        while len(self._cancelled) > MAX_CANCELLED_TAGS:
            self._cancelled.popitem(last=False)

    def cancel_all(self) -> None:
        self.cancel(list(self._receives))

    async def send(
        self,
        tag: int,
        peer_id: str,
        peer_address: bytes,
        block_ids: Sequence[int],
        peer_layout: Layout = ONE_PROCESS,
        peer_rank_addresses: Sequence[bytes] = (),
    ) -> TransferResult:
        """Gather the blocks into a staging buffer where the pool is (host or device memory)
        and send it: UCX reads device memory itself. Where either worker is parallel,
        every rank sends its own messages (`kv_layout_transfer`)."""
        started = time.perf_counter()
        self._check_blocks(block_ids)
        if self.layout != ONE_PROCESS or peer_layout != ONE_PROCESS:
            nbytes = await self.layouts.send(
                tag, peer_id, peer_layout, (peer_address, *peer_rank_addresses), block_ids
            )
            return TransferResult(nbytes, time.perf_counter() - started)
        nbytes = len(block_ids) * self.kv_cache.block_bytes
        # A failed transfer's buffer is not reused: UCX may still hold it.
        buffer = self.staging.acquire(nbytes)
        await self._on_tensor_thread(self._gather, list(block_ids), buffer)
        await self.transport.send(peer_id, peer_address, tag, buffer)
        self.staging.release(buffer)
        return TransferResult(nbytes, time.perf_counter() - started)

    def _gather(self, block_ids: list[int], buffer) -> None:
        """On the tensor thread: the blocks into `buffer`, complete before UCX reads it (a
        device gather is waited for: UCX copies on its own streams)."""
        staged = buffer if isinstance(buffer, torch.Tensor) else torch.from_numpy(buffer)
        self.kv_cache.gather_blocks(block_ids, staged.view(len(block_ids), -1))
        if staged.device.type == "cuda":
            torch.cuda.current_stream(staged.device).synchronize()

    async def receive(
        self,
        tag: int,
        block_ids: Sequence[int],
        after_step_id: int = 0,
        sender_layout: Layout = ONE_PROCESS,
    ) -> TransferResult:
        """Receive into a staging buffer where the pool is (host or device memory), then
        scatter it into the blocks. Not straight into the pool: a UCX receive cannot be
        cancelled, and a late message must never land in blocks given to someone else.
        Where either worker is parallel, every rank receives its own messages."""
        started = time.perf_counter()
        self._start_receive(tag, block_ids)
        try:
            if self.layout != ONE_PROCESS or sender_layout != ONE_PROCESS:
                nbytes = await self.layouts.receive(
                    tag, sender_layout, block_ids, lambda: self._wait_for_step(after_step_id),
                    self.is_cancelled,
                )  # fmt: skip
                return TransferResult(nbytes, time.perf_counter() - started)
            nbytes = len(block_ids) * self.kv_cache.block_bytes
            # A cancelled or failed receive's buffer is not reused: UCX may still write it.
            buffer = self.staging.acquire(nbytes)
            await self.transport.receive(tag, nbytes, out=buffer)
            await self._wait_for_step(after_step_id)
        finally:
            self._receives.pop(tag, None)
        # Checked and queued in one go (no await between): a cancel that reaches this
        # worker later comes with a step queued behind this scatter on the tensor thread.
        if tag in self._cancelled:
            raise KvTransferCancelled(f"transfer {tag:#x} was cancelled")
        await self._on_tensor_thread(self._scatter, list(block_ids), buffer)
        self.staging.release(buffer)
        return TransferResult(nbytes, time.perf_counter() - started)

    def _scatter(self, block_ids: list[int], buffer) -> None:
        """On the tensor thread: `buffer` into the blocks, done before the buffer is reused
        (a device scatter is waited for)."""
        staged = buffer if isinstance(buffer, torch.Tensor) else torch.from_numpy(buffer)
        self.kv_cache.scatter_blocks(block_ids, staged.view(len(block_ids), -1))
        if staged.device.type == "cuda":
            torch.cuda.current_stream(staged.device).synchronize()

    async def pull(
        self, tag: int, source: KvSource, block_ids: Sequence[int], after_step_id: int = 0
    ) -> PullResult:
        """Copy blocks out of a same-host peer's shared pool (see kv_pull)."""
        if self.peers is not None and self.puller.ranks is None:
            raise KvTransferError("a parallel worker without shared pools cannot pull KV")
        self._start_receive(tag, block_ids)
        try:
            return await self.puller.pull(
                tag, source, block_ids, lambda: self._wait_for_step(after_step_id)
            )
        finally:
            self._receives.pop(tag, None)

    def _start_receive(self, tag: int, block_ids: Sequence[int]) -> None:
        self._check_blocks(block_ids)
        if tag in self._cancelled:
            raise KvTransferCancelled(f"transfer {tag:#x} was cancelled")
        self._receives[tag] = asyncio.current_task()

    def _check_blocks(self, block_ids: Sequence[int]) -> None:
        if not block_ids:
            raise KvTransferError("a transfer needs at least one block")
        bad = [b for b in block_ids if not 0 <= b < self.kv_cache.num_blocks]
        if bad:
            raise KvTransferError(
                f"block ids {bad[:4]} outside the pool of {self.kv_cache.num_blocks}"
            )

    async def close(self) -> None:
        self.puller.close()
        await self.transport.close()
