"""A loaded worker: model, KV pool, persistent batch, runner and UCX transport.

All tensor work (loading, forward passes, block gathers and scatters) runs on one executor
thread, so KV transfers and steps never touch the pool at the same time and the event loop
stays free for gRPC and UCX. One thread matters for speed too: OpenMP keeps a team of
threads per thread that runs parallel torch ops, and libgomp stops spin-waiting in every
team once a process holds more OpenMP threads than the machine has cores; a second team
(e.g. from loading on another thread) made every CPU step about 2.5x slower.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from common.kv_shared_memory import SharedMemoryInfo
from common.log import get_logger
from common.parallel_plan import Layout
from common.pb.tandem.internal.v1 import worker_pb2
from common.step_plan import BlockMoves, CachedRequestData, NewRequestData
from common.step_result import StepResult
from common.structured_output import Constraint
from services.worker.batch import PersistentBatch, PlanError
from services.worker.block_moves import check_moves, run_moves, run_saves
from services.worker.compute_lock import ComputeLock, make_compute_lock
from services.worker.config import WorkerConfig
from services.worker.kv_cache import KvCache
from services.worker.kv_layout_transfer import LayoutTransfers
from services.worker.kv_pull import KvPuller, KvSource, PullResult
from services.worker.kv_shared import PeerPool
from services.worker.kv_transfer import (
    KvTransferCancelled,
    KvTransferError,
    TransferDeadline,
    UcxTransport,
)
from services.worker.parallel.kv_ranks import KvGeometry, RankPools
from services.worker.parallel.peer_ranks import PeerRanks, start_peer_ranks
from services.worker.parallel.rank_context import RankContext
from services.worker.runner import ModelRunner
from services.worker.spec_decode.proposers import make_proposer
from services.worker.staging import StagingBuffers
from services.worker.startup import LoadedWorker, load_worker
from services.worker.structured.state import StructuredOutputs

log = get_logger(__name__)

KV_LAYOUT = "block,layer,kv,slot,head,dim"
NO_MOVES = BlockMoves()
ONE_PROCESS = Layout()
# Cancelled transfer tags remembered (a cancel may arrive before its receive does).
MAX_CANCELLED_TAGS = 65536


def tensor_executor() -> ThreadPoolExecutor:
    """The one thread that runs a worker's torch work."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="tensor")


class LoraDisabledError(RuntimeError):
    """A LoRA call reached a worker started without --enable-lora."""


@dataclass(frozen=True)
class TransferResult:
    num_bytes: int
    seconds: float


@dataclass(frozen=True)
class WorkerParts:
    """Everything a `Worker` is made of, loaded by `Worker.load`: its settings and id, the
    model and pools (`startup.LoadedWorker`), the tensor thread and the host's compute lock,
    and for rank 0 of a parallel worker its other ranks (`peers`, `ranks`), where their
    pools are (pulled KV heads are copied straight into them) and their UCX workers (which
    send and receive their own KV heads)."""

    config: WorkerConfig
    worker_id: str
    loaded: LoadedWorker
    executor: ThreadPoolExecutor
    compute_lock: ComputeLock | None = None
    peers: PeerRanks | None = None
    ranks: RankContext | None = None
    rank_shared_memory: tuple[SharedMemoryInfo | None, ...] = ()
    rank_ucx_addresses: tuple[bytes, ...] = ()


class Worker:
    def __init__(self, parts: WorkerParts) -> None:
        config, loaded = parts.config, parts.loaded
        self.config, self.worker_id, self.role = config, parts.worker_id, config.role
        self.peers, self.layout = parts.peers, config.layout
        self.rank_shared_memory = parts.rank_shared_memory
        self.rank_ucx_addresses = parts.rank_ucx_addresses
        self._rank_maps: list[PeerPool] = []
        self.model_config, self.max_model_len = loaded.model_config, loaded.max_model_len
        self.kv_cache, self.swap_cache = loaded.kv_cache, loaded.swap_cache
        self.offload_cache = loaded.offload_cache
        self.disk_offload = loaded.disk_offload
        self.kv_groups = loaded.kv_groups or loaded.model_config.kv_groups(hybrid=False)
        self.device, self.lora, self.shared_pool = loaded.device, loaded.lora, loaded.shared_pool
        self.speculative = config.speculative
        self._executor, self.compute_lock = parts.executor, parts.compute_lock
        self.runner = self._make_runner(parts)
        self.batch = PersistentBatch(
            loaded.kv_cache.block_size,
            loaded.kv_cache.num_blocks,
            loaded.model_config.vocab_size,
            loaded.kv_cache.num_groups,
        )
        self.executed_step_id = 0
        self._step_done = asyncio.Condition()
        self._report_progress()
        self._start_kv_movement(parts)

    def _make_runner(self, parts: WorkerParts) -> ModelRunner:
        """The model runner: the model, its pool, CUDA graphs, the speculative proposer, the
        LoRA adapters and the grammar masks (xgrammar and the tokenizer load on first use,
        on the grammar thread)."""
        config, loaded = parts.config, parts.loaded
        return ModelRunner(
            loaded.model,
            loaded.kv_cache,
            loaded.device,
            loaded.graphs,
            proposer=make_proposer(
                self.speculative, loaded.draft, loaded.draft_cache, loaded.device
            ),
            tokens=None if parts.ranks is None else parts.ranks.tokens,
            lora=loaded.lora,
            structured=StructuredOutputs(
                config.model,
                loaded.model_config.vocab_size,
                any_whitespace=not config.structured_outputs_disable_any_whitespace,
            ),
        )

    def _report_progress(self) -> None:
        """Only a prefill worker's prompts are streamed while they compute: only it reports
        its progress in its shared pool's header (a peer pulling from any other worker's
        pool copies final blocks)."""
        self._progress = self.shared_pool if self.role == "prefill" else None
        self._running_step_id = 0
        if self._progress is not None:
            self.kv_cache.on_layer_written = self._layer_written

    def _start_kv_movement(self, parts: WorkerParts) -> None:
        """The three ways KV moves: UCX (`transport`), the same-host pull (`puller`) and the
        transfers between workers of different layouts (`layout_transfers`)."""
        config = parts.config
        if self.device.type == "cuda":  # UCX's CUDA transports need a current context here
            torch.cuda.set_device(self.device)
        self.transport = UcxTransport(
            timeout_s=config.kv_transfer_timeout_s,
            error_handling=config.kv_transfer_error_handling,
            deadline=TransferDeadline.from_config(config),
        )
        self.staging = StagingBuffers(device=self.device)
        self._cancelled_tags: OrderedDict[int, None] = OrderedDict()
        self._receives: dict[int, asyncio.Task] = {}
        self.puller = KvPuller(
            self.kv_cache,
            self._copy_on_tensor_thread,
            lambda tag: tag in self._cancelled_tags,
            config.kv_transfer_timeout_s,
            config.kv_transfer_stream_min_copy_bytes,
            self._rank_pools(parts.loaded) if parts.ranks is not None else None,
            self.kv_groups,
        )
        self.layout_transfers = LayoutTransfers(
            self._geometry(), self.layout, self.kv_cache.data, self.transport, self.peers,
            self._on_tensor_thread,
        )  # fmt: skip

    def _geometry(self) -> KvGeometry:
        c = self.model_config
        return KvGeometry(
            c.num_attention_heads, c.num_key_value_heads, c.num_hidden_layers,
            self.kv_cache.block_size, c.head_dim, self.kv_groups,
        )  # fmt: skip

    def _rank_pools(self, loaded: LoadedWorker) -> RankPools | None:
        """Every rank's pool, the others' mapped writable (None without shared memory)."""
        if loaded.shared_pool is None or None in self.rank_shared_memory:
            return None
        geometry = self._geometry()
        layout = self.layout
        self._rank_maps = [
            PeerPool(info, geometry.block_shape(layout, rank), self.kv_cache.dtype, writable=True)
            for rank, info in enumerate(self.rank_shared_memory, start=1)
        ]
        pools = [self.kv_cache.data, *(m.data for m in self._rank_maps)]
        return RankPools(geometry, layout, pools)

    @property
    def model_block_bytes(self) -> int:
        """One block of the whole model's KV (every head, every layer of a KV group): what
        the scheduler compares between workers, whatever their parallel layouts."""
        c = self.model_config
        return KvCache.bytes_per_block(
            self.kv_cache.block_size, self.kv_groups.size, c.num_key_value_heads, c.head_dim,
            self.kv_cache.dtype,
        )  # fmt: skip

    @classmethod
    async def load(cls, config: WorkerConfig, worker_id: str) -> Worker:
        """Load weights and allocate the KV pool on the tensor thread (off the event loop;
        loading does not take the compute lock: workers starting together may overlap);
        UCX starts on the loop."""
        executor = tensor_executor()
        loop = asyncio.get_running_loop()
        peers = None
        if config.world_size > 1:  # rank 0 here; the others start as processes of their own
            peers, ranks = await loop.run_in_executor(executor, start_peer_ranks, config)
        else:
            ranks = None
        try:
            loaded = await loop.run_in_executor(executor, load_worker, config, worker_id, ranks)
            rank_pools, rank_ucx = (), ()
            if ranks is not None:  # where the other ranks' pools and UCX workers are
                rank_pools = await loop.run_in_executor(executor, ranks.collect_pools)
                rank_ucx = await loop.run_in_executor(executor, ranks.collect_ucx_addresses)
        except BaseException:
            if peers is not None:
                peers.close()
            raise
        lock = make_compute_lock(config.cpu_compute_lock, loaded.device.type)
        return cls(
            WorkerParts(
                config, worker_id, loaded, executor, lock, peers, ranks, tuple(rank_pools),
                tuple(a for a in rank_ucx if a),
            )
        )  # fmt: skip

    def _submit(self, fn, *args) -> concurrent.futures.Future:
        """Queue `fn` on the tensor thread (run holding the host's compute lock, if any)."""
        if self.compute_lock is not None:
            fn, args = self.compute_lock.run, (fn, *args)
        return self._executor.submit(fn, *args)

    async def _on_tensor_thread(self, fn, *args):
        return await asyncio.wrap_future(self._submit(fn, *args))

    async def _copy_on_tensor_thread(self, fn, *args):
        """Block copies streamed from a peer: on the tensor thread (ordered with the steps)
        but without the host's compute lock, which the peer holds while it computes them."""
        return await asyncio.wrap_future(self._executor.submit(fn, *args))

    async def add_lora(self, name: str, path: str) -> list[str]:
        """Serve the LoRA adapter in folder `path` as `name` (read and checked on the tensor
        thread, between steps; raises ValueError saying why it cannot be applied). Returns
        the adapters now served."""
        if self.lora is None:
            raise LoraDisabledError("this worker runs without --enable-lora")
        await self._on_tensor_thread(self.lora.add, name, path)
        return self.lora.names

    async def remove_lora(self, name: str) -> list[str]:
        """Stop serving `name` (no-op when not served); returns the adapters still served."""
        if self.lora is None:
            raise LoraDisabledError("this worker runs without --enable-lora")
        await self._on_tensor_thread(self.lora.remove, name)
        return self.lora.names

    async def prepare_structured(self, constraint: Constraint) -> float:
        """Compile `constraint` off the tensor thread (ConstraintError when it cannot be);
        returns the seconds the compile took."""
        return await asyncio.wrap_future(self.runner.structured.prepare(constraint))

    def submit_step(
        self,
        finished_ids: Sequence[str],
        new: Sequence[NewRequestData],
        cached: Sequence[CachedRequestData],
        moves: BlockMoves = NO_MOVES,
        step_id: int = 0,
        wire: worker_pb2.StepRequest | None = None,
    ) -> concurrent.futures.Future:
        """Queue a whole step on the tensor thread: apply the plan to the persistent batch,
        the block moves, the forward pass, the progress. Steps run in submission order and
        back to back (the next starts when the previous ends, with no round trip through
        the event loop). The future holds the StepResult, or the PlanError. `wire`: the
        plan as received, which a parallel worker's other ranks need."""
        if self.peers is not None and wire is None:
            raise ValueError("a parallel worker needs each step's StepRequest")
        return self._submit(self._run_step, finished_ids, new, cached, moves, step_id, wire)

    def _run_step(
        self, finished_ids, new, cached, moves: BlockMoves, step_id: int, wire
    ) -> StepResult:
        if self.peers is not None:  # the other ranks run the same plan on their slices
            self.peers.send_step(wire)
        work = self.batch.apply(finished_ids, new, cached)
        if self.runner.structured is not None:  # a request that comes back starts afresh
            self.runner.structured.forget(finished_ids)
        disk = self._disk_moves(moves)  # into offload blocks held for them
        offload_s = run_moves(moves, self.kv_cache, self.swap_cache, self.offload_cache)
        if self._progress is not None:  # peers stream this step's KV layer by layer
            self._running_step_id = step_id
            self._progress.step_started(step_id)
        output = self.runner.execute(work, step_id)
        run_saves(moves, self.kv_cache, self.offload_cache)
        if self.disk_offload is not None:
            disk["disk_removed"] = tuple(self.disk_offload.take_removed())
        if offload_s or disk:
            output = replace(output, offload_load_seconds=offload_s, **disk)
        if self._progress is not None:
            self._progress.step_done(step_id)
        self.batch.complete(work, output.sampled, output.accepted_tokens)
        return output

    def _disk_moves(self, moves: BlockMoves) -> dict:
        """A step's disk tier writes, then reads, before its forward pass (a write copies
        its offload block out at once): the result's fields."""
        if not moves.disk_loads and not moves.disk_saves:
            return {}
        if self.disk_offload is None:
            raise PlanError("the plan moves disk tier blocks but this worker has none")
        check_moves(moves, self.kv_cache, self.swap_cache, self.offload_cache)
        self.disk_offload.save(moves.disk_saves, self.offload_cache)  # reads may reuse them
        started = time.perf_counter()
        loaded, failed = self.disk_offload.load(moves.disk_loads, self.offload_cache)
        return {
            "disk_loaded": tuple(loaded),
            "disk_failed": tuple(failed),
            "disk_read_seconds": time.perf_counter() - started if moves.disk_loads else 0.0,
        }

    def _layer_written(self, layer: int) -> None:
        self._progress.layer_done(self._running_step_id, layer)

    async def step(
        self,
        step_id: int,
        finished_ids: Sequence[str],
        new: Sequence[NewRequestData],
        cached: Sequence[CachedRequestData],
        moves: BlockMoves = NO_MOVES,
    ) -> StepResult:
        """Run one step now and mark it executed."""
        output = await asyncio.wrap_future(
            self.submit_step(finished_ids, new, cached, moves, step_id)
        )
        await self.mark_executed(step_id)
        return output

    async def mark_executed(self, step_id: int) -> None:
        """Step `step_id` has run: receives waiting for it may scatter now."""
        async with self._step_done:
            self.executed_step_id = step_id
            self._step_done.notify_all()

    @property
    def is_idle(self) -> bool:
        """No request in the batch and no KV receive under way."""
        return not len(self.batch) and not self._receives

    def reset(self) -> None:
        """Forget every request (its scheduler went away or a new one took over); step ids
        restart and receives still waiting are abandoned. The batch is cleared on the
        tensor thread, after any step still queued there."""
        self._executor.submit(self._clear)
        self.executed_step_id = 0
        self.cancel_transfers(list(self._receives))

    def _clear(self) -> None:
        self.batch.clear()
        if self.runner.structured is not None:
            self.runner.structured.reset()
        if self.peers is not None:
            self.peers.reset()
        if self._progress is not None:
            self._progress.reset()

    def cancel_transfers(self, tags: Iterable[int]) -> None:
        """The scheduler gave up on these receives: none of them may write into the pool
        from now on (their blocks may already belong to another request)."""
        for tag in tags:
            self._cancelled_tags[tag] = None
            self._cancelled_tags.move_to_end(tag)
            task = self._receives.get(tag)
            if task is not None:
                task.cancel()
        while len(self._cancelled_tags) > MAX_CANCELLED_TAGS:
            self._cancelled_tags.popitem(last=False)

    async def wait_for_step(self, step_id: int) -> None:
        """Return once step `step_id` (or a later one) has executed."""
        async with self._step_done:
            await self._step_done.wait_for(lambda: self.executed_step_id >= step_id)

    async def send_kv(
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
        if self.layout != Layout() or peer_layout != Layout():
            nbytes = await self.layout_transfers.send(
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

    async def receive_kv(
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
        self._check_blocks(block_ids)
        if tag in self._cancelled_tags:
            raise KvTransferCancelled(f"transfer {tag:#x} was cancelled")
        if self.layout != Layout() or sender_layout != Layout():
            self._receives[tag] = asyncio.current_task()
            try:
                nbytes = await self.layout_transfers.receive(
                    tag, sender_layout, block_ids, lambda: self.wait_for_step(after_step_id),
                    lambda t: t in self._cancelled_tags,
                )  # fmt: skip
            finally:
                self._receives.pop(tag, None)
            return TransferResult(nbytes, time.perf_counter() - started)
        nbytes = len(block_ids) * self.kv_cache.block_bytes
        self._receives[tag] = asyncio.current_task()
        try:
            # A cancelled or failed receive's buffer is not reused: UCX may still write it.
            buffer = self.staging.acquire(nbytes)
            await self.transport.receive(tag, nbytes, out=buffer)
            await self.wait_for_step(after_step_id)
        finally:
            self._receives.pop(tag, None)
        # Checked and queued in one go (no await between): a cancel that reaches this
        # worker later comes with a step queued behind this scatter on the tensor thread.
        if tag in self._cancelled_tags:
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

    async def pull_kv(
        self, tag: int, source: KvSource, block_ids: Sequence[int], after_step_id: int = 0
    ) -> PullResult:
        """Copy blocks out of a same-host peer's shared pool (see kv_pull)."""
        if self.peers is not None and self.puller.ranks is None:
            raise KvTransferError("a parallel worker without shared pools cannot pull KV")
        self._check_blocks(block_ids)
        if tag in self._cancelled_tags:
            raise KvTransferCancelled(f"transfer {tag:#x} was cancelled")
        self._receives[tag] = asyncio.current_task()
        try:
            return await self.puller.pull(
                tag, source, block_ids, lambda: self.wait_for_step(after_step_id)
            )
        finally:
            self._receives.pop(tag, None)

    def _check_blocks(self, block_ids: Sequence[int]) -> None:
        if not block_ids:
            raise KvTransferError("a transfer needs at least one block")
        bad = [b for b in block_ids if not 0 <= b < self.kv_cache.num_blocks]
        if bad:
            raise KvTransferError(
                f"block ids {bad[:4]} outside the pool of {self.kv_cache.num_blocks}"
            )

    async def close(self) -> None:
        if self.peers is not None:
            self.peers.close()
        self.puller.close()
        for mapped in self._rank_maps:
            mapped.close()
        await self.transport.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self.disk_offload is not None:
            self.disk_offload.close()  # every file in flight written
        self.runner.structured.close()
        if self.compute_lock is not None:
            self.compute_lock.close()
