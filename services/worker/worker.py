"""A loaded worker: model, KV pool, persistent batch, runner and UCX transport.

All tensor work (forward passes, block gathers and scatters) runs on one executor thread,
so KV transfers and steps never touch the pool at the same time; the event loop stays free
for gRPC and UCX.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from common.config import parse_size
from common.log import get_logger
from common.model_config import ModelConfig
from services.worker.batch import (
    BlockMoves,
    CachedRequestData,
    NewRequestData,
    PersistentBatch,
    PlanError,
)
from services.worker.config import WorkerConfig
from services.worker.kv_cache import KvCache
from services.worker.kv_transfer import KvTransferError, UcxTransport
from services.worker.models.loader import load_model
from services.worker.runner import ModelRunner, StepOutput
from services.worker.staging import StagingBuffers

log = get_logger(__name__)

KV_LAYOUT = "block,layer,kv,slot,head,dim"
NO_MOVES = BlockMoves()


@dataclass(frozen=True)
class TransferResult:
    num_bytes: int
    seconds: float


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for but CUDA is not available")
    return device


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: str) -> torch.dtype:
    if name == "auto":
        name = "float32" if device.type == "cpu" else checkpoint_dtype
    return getattr(torch, name)


def kv_pool_bytes(config: WorkerConfig, device: torch.device) -> int:
    """Memory the KV pool may take, measured after the weights are loaded."""
    if device.type != "cuda":
        return parse_size(config.kv_cache_memory)
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    return max(0, int(total * config.gpu_memory_utilization) - used)


def load_model_and_pool(
    config: WorkerConfig, worker_id: str
) -> tuple[torch.nn.Module, ModelConfig, KvCache, int, torch.device, KvCache | None]:
    """Load weights, then size and allocate the KV pool from the memory left (blocking)."""
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    device = resolve_device(config.device)
    model_config = ModelConfig.from_folder(config.model)
    dtype = resolve_dtype(config.dtype, device, model_config.torch_dtype)
    started = time.perf_counter()
    model, model_config = load_model(config.model, dtype=dtype, device=device)
    geometry = dict(
        block_size=config.block_size,
        num_layers=model_config.num_hidden_layers,
        num_kv_heads=model_config.num_key_value_heads,
        head_dim=model_config.head_dim,
        dtype=dtype,
    )
    num_blocks = config.num_blocks or KvCache.num_blocks_for_bytes(
        kv_pool_bytes(config, device), **geometry
    )
    max_model_len = min(
        config.max_model_len or model_config.max_position_embeddings,
        model_config.max_position_embeddings,
    )
    if num_blocks * config.block_size < max_model_len:
        raise ValueError(
            f"the KV pool ({num_blocks} blocks of {config.block_size} tokens) cannot hold "
            f"one request of max_model_len={max_model_len} tokens: raise "
            f"kv_cache_memory/num_blocks or lower max_model_len"
        )
    kv_cache = KvCache(num_blocks=num_blocks, device=device, **geometry)
    num_swap_blocks = parse_size(config.swap_space) // kv_cache.block_bytes
    swap_cache = (
        KvCache(num_blocks=num_swap_blocks, device="cpu", zeroed=False, **geometry)
        if num_swap_blocks
        else None
    )
    log.info(
        "worker_loaded",
        worker_id=worker_id,
        role=config.role,
        model=model_config.name,
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        num_blocks=num_blocks,
        kv_pool_mib=round(num_blocks * kv_cache.block_bytes / 2**20, 1),
        swap_blocks=num_swap_blocks,
        max_model_len=max_model_len,
        seconds=round(time.perf_counter() - started, 2),
    )
    return model, model_config, kv_cache, max_model_len, device, swap_cache


class Worker:
    def __init__(
        self,
        config: WorkerConfig,
        worker_id: str,
        model: torch.nn.Module,
        model_config: ModelConfig,
        kv_cache: KvCache,
        max_model_len: int,
        device: torch.device,
        swap_cache: KvCache | None = None,
    ) -> None:
        self.config = config
        self.worker_id = worker_id
        self.role = config.role
        self.model_config = model_config
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.device = device
        self.runner = ModelRunner(model, kv_cache, device)
        self.batch = PersistentBatch(
            kv_cache.block_size, kv_cache.num_blocks, model_config.vocab_size
        )
        self.transport = UcxTransport(
            timeout_s=config.kv_transfer_timeout_s,
            error_handling=config.kv_transfer_error_handling,
        )
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tensor")
        self.swap_cache = swap_cache
        self.staging = StagingBuffers()
        self.executed_step_id = 0
        self._step_done = asyncio.Condition()

    @classmethod
    async def load(cls, config: WorkerConfig, worker_id: str) -> Worker:
        """Load weights and allocate the KV pool off the event loop; UCX starts on the loop."""
        parts = await asyncio.to_thread(load_model_and_pool, config, worker_id)
        return cls(config, worker_id, *parts)

    async def _on_tensor_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def step(
        self,
        step_id: int,
        finished_ids: Sequence[str],
        new: Sequence[NewRequestData],
        cached: Sequence[CachedRequestData],
        moves: BlockMoves = NO_MOVES,
    ) -> StepOutput:
        work = self.batch.apply(finished_ids, new, cached)
        if moves:
            self._check_moves(moves)
            await self._on_tensor_thread(self._move_blocks, moves)
        output = await self._on_tensor_thread(self.runner.execute, work)
        self.batch.complete(work, output.sampled)
        async with self._step_done:
            self.executed_step_id = step_id
            self._step_done.notify_all()
        return output

    def _check_moves(self, moves: BlockMoves) -> None:
        swap_blocks = 0 if self.swap_cache is None else self.swap_cache.num_blocks
        if (moves.swap_out or moves.swap_in) and not swap_blocks:
            raise PlanError("the plan swaps blocks but this worker has no swap space")
        for name, pairs, (src_n, dst_n) in (
            ("swap_out", moves.swap_out, (self.kv_cache.num_blocks, swap_blocks)),
            ("swap_in", moves.swap_in, (swap_blocks, self.kv_cache.num_blocks)),
            ("block_copies", moves.copies, (self.kv_cache.num_blocks,) * 2),
        ):
            bad = [p for p in pairs if not (0 <= p[0] < src_n and 0 <= p[1] < dst_n)]
            if bad:
                raise PlanError(f"{name} pairs {bad[:4]} are outside the pools")

    def _move_blocks(self, moves: BlockMoves) -> None:
        if moves.swap_out:
            self.swap_cache.copy_blocks(moves.swap_out, source=self.kv_cache)
        if moves.swap_in:
            self.kv_cache.copy_blocks(moves.swap_in, source=self.swap_cache)
        self.kv_cache.copy_blocks(moves.copies)

    def reset(self) -> None:
        """Forget every request (a new scheduler took over); step ids restart."""
        self.batch.clear()
        self.executed_step_id = 0

    async def wait_for_step(self, step_id: int) -> None:
        """Return once step `step_id` (or a later one) has executed."""
        async with self._step_done:
            await self._step_done.wait_for(lambda: self.executed_step_id >= step_id)

    async def send_kv(
        self, tag: int, peer_id: str, peer_address: bytes, block_ids: Sequence[int]
    ) -> TransferResult:
        started = time.perf_counter()
        self._check_blocks(block_ids)
        nbytes = len(block_ids) * self.kv_cache.block_bytes
        if self.device.type != "cpu":  # device memory: gather there, then one copy to host
            payload = await self._on_tensor_thread(self.kv_cache.gather_blocks, list(block_ids))
            await self.transport.send(peer_id, peer_address, tag, payload.cpu().numpy())
            return TransferResult(nbytes, time.perf_counter() - started)
        # A failed transfer's buffer is not reused: UCX may still hold it.
        buffer = self.staging.acquire(nbytes)
        staged = torch.from_numpy(buffer).view(len(block_ids), self.kv_cache.block_bytes)
        await self._on_tensor_thread(self.kv_cache.gather_blocks, list(block_ids), staged)
        await self.transport.send(peer_id, peer_address, tag, buffer)
        self.staging.release(buffer)
        return TransferResult(nbytes, time.perf_counter() - started)

    async def receive_kv(
        self, tag: int, block_ids: Sequence[int], after_step_id: int = 0
    ) -> TransferResult:
        started = time.perf_counter()
        self._check_blocks(block_ids)
        nbytes = len(block_ids) * self.kv_cache.block_bytes
        buffer = self.staging.acquire(nbytes)
        await self.transport.receive(tag, nbytes, out=buffer)
        await self.wait_for_step(after_step_id)
        payload = torch.from_numpy(buffer).view(len(block_ids), self.kv_cache.block_bytes)
        await self._on_tensor_thread(
            self.kv_cache.scatter_blocks, list(block_ids), payload.to(self.device)
        )
        self.staging.release(buffer)
        return TransferResult(nbytes, time.perf_counter() - started)

    def _check_blocks(self, block_ids: Sequence[int]) -> None:
        if not block_ids:
            raise KvTransferError("a transfer needs at least one block")
        bad = [b for b in block_ids if not 0 <= b < self.kv_cache.num_blocks]
        if bad:
            raise KvTransferError(
                f"block ids {bad[:4]} outside the pool of {self.kv_cache.num_blocks}"
            )

    async def close(self) -> None:
        await self.transport.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
