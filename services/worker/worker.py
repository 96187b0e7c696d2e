"""A loaded worker: model, KV pool, persistent batch, runner, and its KV connectors (KV
between workers, the offload tiers: `kv_connector`), called at fixed points of each step.

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
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from common.kv_shared_memory import SharedMemoryInfo
from common.log import get_logger
from common.pb.tandem.internal.v1 import worker_pb2
from common.step_plan import BlockMoves, CachedRequestData, NewRequestData
from common.step_result import StepResult
from common.structured_output import Constraint
from services.worker.batch import PersistentBatch
from services.worker.block_moves import check_moves, run_copies, run_swaps
from services.worker.compute_lock import ComputeLock, make_compute_lock
from services.worker.config import WorkerConfig
from services.worker.kv_cache import KvCache
from services.worker.kv_connector import KvConnector, KvConnectors
from services.worker.kv_offload_connector import OffloadConnector
from services.worker.kv_peer_connector import PeerKvConnector
from services.worker.kv_shared import PeerPool
from services.worker.parallel.kv_ranks import KvGeometry, RankPools
from services.worker.parallel.peer_ranks import PeerRanks, start_peer_ranks
from services.worker.parallel.rank_context import RankContext
from services.worker.runner import ModelRunner
from services.worker.spec_decode.proposers import make_proposer
from services.worker.startup import LoadedWorker, load_worker
from services.worker.structured.state import StructuredOutputs

log = get_logger(__name__)

KV_LAYOUT = "block,layer,kv,slot,head,dim"
NO_MOVES = BlockMoves()


def tensor_executor() -> ThreadPoolExecutor:
    """The one thread that runs a worker's torch work."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="tensor")


class LoraDisabledError(RuntimeError):
    """A LoRA call reached a worker started without --enable-lora."""


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
        self.peer_kv = self._peer_connector(parts)
        connectors: list[KvConnector] = [self.peer_kv]
        if self.offload_cache is not None:
            offload = OffloadConnector(
                self.kv_cache, self.offload_cache, self.disk_offload,
                agree=None if parts.ranks is None else parts.ranks.all_min,
            )  # fmt: skip
            connectors.append(offload)
        self.kv_connectors = KvConnectors(connectors)
        if self.kv_connectors.saves_layers:
            self.kv_cache.on_layer_written = self.kv_connectors.save_kv_layer
        if self.kv_connectors.loads_layers:
            self.kv_cache.on_layer_needed = self.kv_connectors.wait_for_layer_load

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

    def _peer_connector(self, parts: WorkerParts) -> PeerKvConnector:
        """KV between workers (`kv_peer_connector`). Only a prefill worker's prompts are
        streamed while they compute: only it reports its progress in its shared pool's
        header (a peer pulling from any other worker's pool copies final blocks)."""
        if self.device.type == "cuda":  # UCX's CUDA transports need a current context here
            torch.cuda.set_device(self.device)
        return PeerKvConnector(
            parts.config, self.kv_cache, self._geometry(), self._on_tensor_thread,
            self._copy_on_tensor_thread, self.wait_for_step,
            progress=self.shared_pool if self.role == "prefill" else None,
            peers=self.peers,
            rank_pools=self._rank_pools(parts.loaded) if parts.ranks is not None else None,
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
        if moves:
            check_moves(moves, self.kv_cache, self.swap_cache, self.offload_cache)
            run_swaps(moves, self.kv_cache, self.swap_cache)
        self.kv_connectors.start_load_kv(moves, step_id)
        run_copies(moves, self.kv_cache)
        output = self.runner.execute(work, step_id)
        self.kv_connectors.wait_for_save(moves, step_id)
        finished = self.kv_connectors.get_finished()
        if finished:
            output = replace(output, **finished)
        self.batch.complete(work, output.sampled, output.accepted_tokens)
        return output

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
        return not len(self.batch) and not self.peer_kv.receiving

    def reset(self) -> None:
        """Forget every request (its scheduler went away or a new one took over); step ids
        restart and receives still waiting are abandoned. The batch is cleared on the
        tensor thread, after any step still queued there."""
        self._executor.submit(self._clear)
        self.executed_step_id = 0
        self.peer_kv.forget_loads()

    def _clear(self) -> None:
        self.batch.clear()
        if self.runner.structured is not None:
            self.runner.structured.reset()
        if self.peers is not None:
            self.peers.reset()
        self.kv_connectors.reset()

    async def wait_for_step(self, step_id: int) -> None:
        """Return once step `step_id` (or a later one) has executed."""
        async with self._step_done:
            await self._step_done.wait_for(lambda: self.executed_step_id >= step_id)

    async def close(self) -> None:
        if self.peers is not None:
            self.peers.close()
        for mapped in self._rank_maps:
            mapped.close()
        await self.kv_connectors.close()  # disk tier: every file in flight written
        self._executor.shutdown(wait=False, cancel_futures=True)
