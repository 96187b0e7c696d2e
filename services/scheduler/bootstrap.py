"""Connect the scheduler to its workers: wait until each has loaded, check that they serve
the same model with compatible KV geometry and that their settings agree with ours, and
build one pool per worker."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import secrets
from collections.abc import Callable

from common.lifecycle import StartupError
from common.log import get_logger
from common.retention import RetentionLimits
from services.scheduler.block_manager import BlockManager
from services.scheduler.config import SchedulerConfig
from services.scheduler.engine import Engine, Resilience
from services.scheduler.kv_offload import HostOffload
from services.scheduler.lookahead import Lookahead
from services.scheduler.lora_registry import LoraRegistry
from services.scheduler.pool import Pool
from services.scheduler.pool_scheduler import PoolScheduler
from services.scheduler.worker_client import WorkerClient
from services.scheduler.worker_types import ModelShape, WorkerInfo, WorkerUnavailableError

log = get_logger(__name__)

# Fields every worker must agree on: the model's shape, and the KV block geometry (a block
# sent by a prefill worker must land byte-for-byte in a decode worker's block).
_SAME_MODEL = (
    "architecture", "vocab_size", "num_layers", "num_kv_heads", "head_dim", "dtype",
    "lora_adapters", "kv_group_windows",
)  # fmt: skip


def check_compatible(infos: list[WorkerInfo]) -> None:
    """Raise ValueError naming the first mismatch between workers."""
    first = infos[0]
    ids = [i.worker_id for i in infos]
    if len(set(ids)) != len(ids):
        raise ValueError(f"worker ids must be unique, got {ids}")
    for info in infos[1:]:
        for name in _SAME_MODEL:
            a, b = getattr(first.model, name), getattr(info.model, name)
            if a != b:
                raise ValueError(
                    f"workers disagree on model {name}: {first.worker_id}={a}, {info.worker_id}={b}"
                )
        if len(info.model.kv_group_windows) > 1 and (
            info.pipeline_parallel_size != first.pipeline_parallel_size
        ):
            raise ValueError(
                "KV groups (a model mixing sliding-window and full layers) move between "
                f"workers of the same pipeline_parallel_size only: {first.worker_id} has "
                f"{first.pipeline_parallel_size}, {info.worker_id} "
                f"{info.pipeline_parallel_size}; start the workers with "
                "--disable-hybrid-kv-cache-manager"
            )
        if (info.block_size, info.block_bytes) != (first.block_size, first.block_bytes):
            raise ValueError(
                f"workers disagree on KV block geometry: {first.worker_id} "
                f"{first.block_size} tokens/{first.block_bytes} B, {info.worker_id} "
                f"{info.block_size} tokens/{info.block_bytes} B"
            )


def check_worker_limits(config: SchedulerConfig, info: WorkerInfo) -> None:
    """Raise StartupError, in one line naming both settings, when a worker's settings do not
    agree with ours. A worker that sent none (older) is not checked.

    - A step may schedule up to max_num_batched_tokens tokens on any worker (prefill chunks,
      recomputes, swap-ins); a GPU worker left room for the activations of a step of
      profile_num_tokens tokens only, so a larger step could run it out of memory.
    - Our kv_transfer_timeout_s is the deadline of the whole SendKv call and KV load (gather,
      UCX, waiting for the planned steps, scatter); the worker's bounds the UCX part only.
      Longer than ours, it could never fire: our deadline would always cancel a stuck
      transfer first, so the worker could neither report it nor drop its broken UCX endpoint
      (kv_transfer.py does on a failure, not on a cancel). Only prefill and decode workers
      transfer KV.
    """
    limits = info.limits
    if limits is None:
        return
    tokens = limits.profile_num_tokens
    if tokens is not None and tokens < config.max_num_batched_tokens:
        raise StartupError(
            f"worker {info.worker_id} profiled activation memory for profile_num_tokens="
            f"{tokens} tokens, but the scheduler's max_num_batched_tokens="
            f"{config.max_num_batched_tokens} allows larger steps: start the worker with "
            f"--profile-num-tokens {config.max_num_batched_tokens} (or the scheduler with "
            f"--max-num-batched-tokens {tokens})"
        )
    timeout = limits.kv_transfer_timeout_s
    if info.role != "both" and timeout is not None and timeout > config.kv_transfer_timeout_s:
        raise StartupError(
            f"worker {info.worker_id} kv_transfer_timeout_s={timeout:g} exceeds the "
            f"scheduler's kv_transfer_timeout_s={config.kv_transfer_timeout_s:g}, the deadline "
            f"of the whole transfer: start the worker with --kv-transfer-timeout-s "
            f"{config.kv_transfer_timeout_s:g} or less (or the scheduler with "
            f"--kv-transfer-timeout-s {timeout:g})"
        )


def pool_scheduler(config: SchedulerConfig, info: WorkerInfo) -> PoolScheduler:
    """The scheduler of one worker's pool, from the worker's geometry and our settings
    (a worker whose settings do not fit ours, also one that rejoins, raises)."""
    check_worker_limits(config, info)
    if config.preemption_mode == "swap" and not info.num_swap_blocks:
        raise ValueError(
            f"preemption_mode=swap but worker {info.worker_id} has no swap space "
            "(start it with --swap-space > 0)"
        )
    swap = (
        BlockManager(
            info.num_swap_blocks,
            info.block_size,
            enable_caching=False,
            group_windows=(None,) * len(info.model.group_windows),
        )
        if config.preemption_mode == "swap"
        else None
    )
    return PoolScheduler(
        BlockManager(
            info.num_blocks,
            info.block_size,
            config.enable_prefix_caching,
            group_windows=info.model.group_windows,
            kv_events=config.enable_kv_cache_events,
        ),
        config.max_num_batched_tokens,
        config.max_num_seqs,
        runs_decodes=info.role != "prefill",
        preemption_mode=config.preemption_mode,
        swap_blocks=swap,
        max_loras=info.max_loras,
        offload=(
            HostOffload(
                info.num_offload_cpu_blocks,
                info.block_size,
                info.offload_disk_hashes if info.num_offload_disk_blocks else None,
            )
            if info.num_offload_cpu_blocks and config.enable_prefix_caching
            else None
        ),
        lookahead=(
            None
            if info.speculative is None or info.role == "prefill"
            else Lookahead(
                info.speculative.num_speculative_tokens,
                info.speculative.disable_by_batch_size,
                goodput=config.speculative_slots == "goodput",
            )
        ),
    )


def model_description(infos: list[WorkerInfo]) -> ModelShape:
    """The served model: the workers' shared shape, with the smallest context length."""
    return dataclasses.replace(
        infos[0].model, max_model_len=min(i.model.max_model_len for i in infos)
    )


def resilience(config: SchedulerConfig) -> Resilience:
    return Resilience(
        max_waiting_requests=config.max_waiting_requests,
        max_waiting_tokens=config.max_waiting_tokens,
        max_restarts=config.max_restarts,
        health_interval_s=config.worker_health_interval_s,
        health_timeout_s=config.worker_health_timeout_s,
        health_max_misses=config.worker_health_max_misses,
        kv_link_cool_down_s=config.kv_link_cool_down_s,
    )


async def connect(
    config: SchedulerConfig, on_serving_change: Callable[[bool], None] | None = None
) -> tuple[Engine, ModelShape]:
    clients = [WorkerClient(address, config.step_timeout_s) for address in config.workers]
    try:
        infos = list(
            await asyncio.gather(*(c.wait_ready(config.worker_ready_timeout_s) for c in clients))
        )
    except WorkerUnavailableError as exc:
        raise StartupError(str(exc)) from exc
    check_compatible(infos)
    model = model_description(infos)
    # Every worker's settings are checked (check_worker_limits) before any stream opens.
    schedulers = [pool_scheduler(config, info) for info in infos]
    pools = []
    for client, info, scheduler in zip(clients, infos, schedulers, strict=True):
        await client.open_step_stream()
        pools.append(Pool(info=info, client=client, scheduler=scheduler))
        log.info(
            "worker_connected",
            worker_id=info.worker_id,
            role=info.role,
            address=info.address,
            num_blocks=info.num_blocks,
            block_size=info.block_size,
        )
    engine = Engine(
        pools,
        max_model_len=model.max_model_len,
        vocab_size=model.vocab_size,
        deployment_salt=config.prefix_cache_salt.encode() or secrets.token_bytes(16),
        kv_transfer_timeout_s=config.kv_transfer_timeout_s,
        kv_transfer_streaming=config.kv_transfer_streaming,
        async_scheduling=config.async_scheduling,
        resilience=resilience(config),
        make_scheduler=functools.partial(pool_scheduler, config),
        on_serving_change=on_serving_change,
        loras=LoraRegistry(model.lora_adapters),
        retention=RetentionLimits(config.max_kv_retention_s),
    )
    return engine, model
