"""Builds a worker's model and KV cache at start: device and dtype, the model with its
attention backend (weights via `models.weight_loader`), the KV pool sized from the memory
actually left, the CPU swap space, and the decode CUDA graphs.

On CUDA the pool gets `gpu_memory_utilization` of the device minus what this worker's
allocator already holds (weights; other processes sharing the GPU do not count, even
while they start beside it), minus the activation
peak of the largest step (measured by one profiling forward pass of `profile_num_tokens`
tokens) and minus the memory the decode graphs take (measured by capturing them once over a
one-block cache, then released). The graphs are then captured for real over the allocated
pool. On CPU the pool gets `kv_cache_memory`.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from common.config import parse_size
from common.kv_groups import KvGroups
from common.log import get_logger
from common.model_config import ModelConfig
from common.rope_config import max_context_length
from services.worker.compute_lock import make_compute_lock
from services.worker.config import WorkerConfig
from services.worker.cuda_graphs import DecodeGraphs, graph_buckets
from services.worker.disk_offload import DiskOffload
from services.worker.kv_cache import KvCache
from services.worker.kv_offload.disk_tier import DiskTier
from services.worker.kv_offload.keys import TierIdentity
from services.worker.kv_shared import SharedPool
from services.worker.lora.adapter import load_adapter
from services.worker.lora.manager import LoraManager
from services.worker.models.attention_backend import select_backend
from services.worker.models.attention_metadata import SequenceSlice, build_attention_metadata
from services.worker.models.weight_loader import load_model
from services.worker.sharding.pipeline_stage import PipelineStage
from services.worker.sharding.tp_group import TpGroup
from services.worker.spec_decode.draft_loader import DraftModel, load_draft

log = get_logger(__name__)

# Left free on the device for the CUDA context's growth, cuBLAS workspaces and fragmentation.
CUDA_HEADROOM_BYTES = 512 * 2**20


@dataclass
class LoadedWorker:
    model: torch.nn.Module
    model_config: ModelConfig
    kv_cache: KvCache
    max_model_len: int
    device: torch.device
    swap_cache: KvCache | None
    graphs: DecodeGraphs | None
    shared_pool: SharedPool | None = None  # the pool's memory, when same-host peers map it
    # speculative decoding's draft model and its pool (the target pool's blocks)
    draft: DraftModel | None = None
    draft_cache: KvCache | None = None
    lora: LoraManager | None = None  # --enable-lora: the adapters and their slots
    kv_groups: KvGroups | None = None  # which layers share a block table (None: all)
    offload_cache: KvCache | None = None  # the host-memory KV offload tier
    disk_offload: DiskOffload | None = None  # and the disk tier behind it


def resolve_device(name: str) -> torch.device:
    """The worker's device; a GPU always with its index ("cuda" is cuda:0), which
    `torch.cuda.set_device` (called before UCX starts) requires."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for but CUDA is not available")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    return device


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: str) -> torch.dtype:
    if name == "auto":
        name = "float32" if device.type == "cpu" else checkpoint_dtype
    return getattr(torch, name)


def load_lora(config: WorkerConfig, model, num_layers: int) -> LoraManager | None:
    """--enable-lora: the model's projections get LoRA slots and --lora-modules are read
    (a bad adapter folder stops the start, naming it); more can be added at run time."""
    if not config.enable_lora:
        return None

    def read(name: str, path: str):
        return load_adapter(name, path, num_layers, config.max_lora_rank)

    lora = LoraManager(model, config.max_loras, config.max_lora_rank, config.cpu_loras, load=read)
    for name, path in config.lora_paths.items():
        lora.add(name, path)
    return lora


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's dtype (`--kv-cache-dtype`)."""
    return model_dtype if name == "auto" else torch.float8_e4m3fn


def _release_cuda() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


@torch.inference_mode()
def profile_activation_bytes(model, geometry: dict, num_tokens: int, device) -> int:
    """Peak memory of one forward pass over `num_tokens` prompt tokens (plus logits)."""
    block_size = geometry["block_size"]
    blocks = -(-num_tokens // block_size)
    cache = KvCache(num_blocks=blocks, device=device, **geometry)
    positions, meta = build_attention_metadata(
        [SequenceSlice(0, num_tokens, range(blocks))], block_size, device
    )
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    hidden = model(ids, positions, cache, meta)
    model.compute_logits(hidden[-1:])
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(device) - base
    del cache, hidden
    _release_cuda()
    return peak


def measure_graph_bytes(model, geometry: dict, buckets, max_model_len: int, device) -> int:
    """Memory the decode graphs hold, from a throwaway capture over a one-block cache."""
    cache = KvCache(num_blocks=1, device=device, **geometry)
    _release_cuda()
    free_before = torch.cuda.mem_get_info(device)[0]
    graphs = DecodeGraphs(model, cache, buckets, max_model_len)
    graphs.capture_all()
    used = free_before - torch.cuda.mem_get_info(device)[0]
    del graphs, cache
    _release_cuda()
    return max(0, used)


# MKL's packed copy of a float32 weight takes about this many times the weight's bytes (the
# largest of the formats `cpu_gemm` may pick; oneDNN's takes the weight's bytes).
PACKED_WEIGHT_FACTOR = 2.6


def wants_packed_weights(config: WorkerConfig, model: torch.nn.Module, device) -> bool:
    """Whether this worker keeps packed weights (`cpu_packed_weights`): only CPU float32
    models; `auto` = when the copies fit in half the memory available now. Prefill workers
    too: Tandem's panels run prompt-sized products 7-28% faster than `torch.mm` on the EPYC
    (their plan keeps them only for the row counts where they won at load)."""
    setting = config.cpu_packed_weights
    if setting == "off" or device.type != "cpu":
        return False
    if setting == "on":
        return True
    if next(model.parameters()).dtype != torch.float32:
        return False
    import psutil

    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return PACKED_WEIGHT_FACTOR * weight_bytes <= psutil.virtual_memory().available / 2


# How long a worker waits for the others on its host to finish measuring their products.
MEASURE_WAIT_S = 180.0


def expert_parallel(tp: TpGroup, config: WorkerConfig) -> TpGroup:
    """The rank's group, splitting experts whole over it when the worker is told to."""
    return replace(tp, expert_parallel=config.enable_expert_parallel)


def pack_taking_turns(config: WorkerConfig, model, device):
    """`model.pack_weights`, holding the host's compute lock: `auto` times the products at
    load, and two workers timing theirs at once on shared cores measure each other (seen:
    ~480 ms for a 5-13 ms pass, and a minute of load time)."""
    lock = make_compute_lock(config.cpu_compute_lock, device.type, MEASURE_WAIT_S)
    if lock is None:
        return model.pack_weights(config.cpu_gemm)
    try:
        return lock.run(model.pack_weights, config.cpu_gemm)
    finally:
        lock.close()


class RankSlice(Protocol):
    """What loading needs of a parallel worker's rank (`parallel.rank_context.RankContext`
    is one): its device, its slice of the model, and the pool size every rank can hold."""

    rank: int
    device: torch.device
    tp: TpGroup
    stage: PipelineStage

    def min_over_ranks(self, value: int) -> int: ...


def threads_per_rank(world_size: int) -> int:
    """Intra-op threads for one rank when the worker is told none: the cores shared out."""
    return max(1, (os.cpu_count() or 1) // world_size)


def load_worker(
    config: WorkerConfig, worker_id: str, ranks: RankSlice | None = None
) -> LoadedWorker:
    """Everything `Worker` needs, loaded and sized (blocking; run off the event loop).
    `ranks`: this process is one rank of a parallel worker: it loads its slice of the model
    (its heads of its stage's layers) and of the pool, on its own device, with as many
    blocks as every rank can hold."""
    if config.torch_threads or ranks is not None:
        torch.set_num_threads(config.torch_threads or threads_per_rank(config.world_size))
    started = time.perf_counter()
    device = resolve_device(config.device) if ranks is None else ranks.device
    model_config = ModelConfig.from_folder(config.model)
    check_features(config, model_config)
    dtype = resolve_dtype(config.dtype, device, model_config.torch_dtype)
    backend = select_backend(config.attention_backend, device)
    check_kv_cache_dtype(config, backend.name, device)
    model, model_config = load_model(
        config.model, dtype=dtype, device=device, attention=backend,
        tp=None if ranks is None else expert_parallel(ranks.tp, config),
        stage=None if ranks is None else ranks.stage,
        # LoRA wraps dense weights: quantized layers are dequantized for it.
        quantized_matmul="dense" if config.enable_lora else config.quantized_matmul,
    )  # fmt: skip
    context = max_context_length(model_config)  # dynamic RoPE: past max_position_embeddings
    max_model_len = min(config.max_model_len or context, context)
    draft = load_draft(config.speculative, model_config, max_model_len, dtype, device, backend)
    packed_bytes, gemm = pack_weights(config, model, draft, device, worker_id)
    lora = load_lora(config, model, model_config.num_hidden_layers)
    groups = kv_groups_for(config, model_config, draft)
    geometry = kv_geometry(config, model, model_config, groups, dtype)
    # Decode steps of a tensor-parallel worker run eagerly (no collectives in the graphs).
    use_graphs = (
        device.type == "cuda"
        and not config.enforce_eager
        and lora is None  # LoRA's per-pass segments are not captured
        and model_config.moe is None  # experts run as many products as have tokens
        and config.role != "prefill"
        and ranks is None
        and not groups.is_hybrid  # the captured metadata holds one block table
    )
    buckets = graph_buckets(config.cuda_graph_max_batch_size)
    pool_bytes, sizing = kv_pool_bytes(
        config, model, geometry, (buckets if use_graphs else None), max_model_len, device
    )
    # A block of the pool is the target's block plus the draft's (same ids, own pools).
    draft_block_bytes = draft.block_bytes(config.block_size) if draft else 0
    num_blocks = config.num_blocks or pool_bytes // (
        KvCache.bytes_per_block(**_block_geometry(geometry)) + draft_block_bytes
    )
    if ranks is not None:  # block ids must mean the same blocks on every rank
        num_blocks = ranks.min_over_ranks(num_blocks)
    check_pool_holds_a_request(num_blocks, config.block_size, groups, max_model_len)
    shared_pool = None
    if device.type == "cpu" and config.kv_transfer_shared_memory:
        shared_pool = SharedPool(
            num_blocks * KvCache.bytes_per_block(**_block_geometry(geometry)),
            model_config.num_hidden_layers,
        )
    kv_cache = KvCache(
        num_blocks=num_blocks,
        device=device,
        storage=None if shared_pool is None else shared_pool.pool,
        **geometry,
    )
    draft_cache = (
        KvCache(num_blocks=num_blocks, device=device, **draft.geometry(config.block_size))
        if draft
        else None
    )
    graphs = None
    if use_graphs:
        graphs = DecodeGraphs(model, kv_cache, buckets, max_model_len)
        graphs.capture_all()
    num_swap_blocks = parse_size(config.swap_space) // kv_cache.block_bytes
    swap_cache = (
        KvCache(num_blocks=num_swap_blocks, device="cpu", zeroed=False, **geometry)
        if num_swap_blocks
        else None
    )
    offload_cache = kv_offload_cache(
        config, groups, geometry, kv_cache.block_bytes, pinned=device.type == "cuda"
    )
    disk_offload = kv_offload_disk(config, model_config.name, kv_cache, ranks)
    log.info(
        "worker_loaded",
        worker_id=worker_id,
        role=config.role,
        rank=0 if ranks is None else ranks.rank,
        world_size=config.world_size,
        model=model_config.name,
        device=str(device),
        dtype=str(dtype).removeprefix("torch."),
        kv_cache_dtype=str(geometry["dtype"]).removeprefix("torch."),
        attention=backend.name,
        cuda_graphs=graphs.num_graphs if graphs else 0,
        packed_weights_mib=round(packed_bytes / 2**20, 1),
        **gemm,
        num_blocks=num_blocks,
        kv_groups=groups.num_groups,
        kv_pool_mib=round(num_blocks * kv_cache.block_bytes / 2**20, 1),
        draft_layers=draft.config.num_hidden_layers if draft else 0,
        draft_kv_pool_mib=round(num_blocks * draft_block_bytes / 2**20, 1),
        swap_blocks=num_swap_blocks,
        offload_cpu_blocks=0 if offload_cache is None else offload_cache.num_blocks,
        offload_disk_blocks=0 if disk_offload is None else disk_offload.capacity_blocks,
        shared_pool=shared_pool is not None,
        max_model_len=max_model_len,
        seconds=round(time.perf_counter() - started, 2),
        **{k: round(v, 3) for k, v in sizing.items()},
    )
    return LoadedWorker(
        model, model_config, kv_cache, max_model_len, device, swap_cache, graphs, shared_pool,
        draft, draft_cache, lora, groups, offload_cache, disk_offload,
    )  # fmt: skip


def kv_offload_disk(
    config: WorkerConfig, model_name: str, kv_cache: KvCache, ranks: RankSlice | None = None
):
    """The disk tier behind the offload pool (`--kv-offload-dir`; None: none). Its files
    are this model's, this geometry's, this KV dtype's and this rank's only (each rank of a
    parallel worker keeps its slice of every block in files of its own)."""
    size = parse_size(config.kv_offload_disk_bytes)
    if not size:
        return None
    identity = TierIdentity(
        model=model_name,
        num_slots=kv_cache.num_layers,
        block_size=kv_cache.block_size,
        block_bytes=kv_cache.block_bytes,
        dtype=kv_cache.dtype,
        **({} if ranks is None else dict(
            tp_rank=ranks.tp.rank, tp_size=ranks.tp.size,
            pp_rank=ranks.stage.stage, pp_size=ranks.stage.size,
        )),
    )  # fmt: skip
    tier = DiskTier(config.kv_offload_dir, size, identity, claim=True)
    if not tier.enabled:
        raise ValueError(
            f"--kv-offload-disk-bytes {config.kv_offload_disk_bytes} holds no block "
            f"(a block's file is {tier.file_bytes} bytes)"
        )
    return DiskOffload(tier)


def kv_offload_cache(
    config: WorkerConfig, groups: KvGroups, geometry, block_bytes: int, pinned: bool = False
):
    """The host-memory offload tier's blocks (`--kv-offload-cpu-bytes`; None: none); in
    page-locked memory beside a GPU (`pinned`), so its copies to and from the device pool
    run at the bus's speed."""
    size = parse_size(config.kv_offload_cpu_bytes)
    if not size:
        return None
    if groups.num_groups > 1 or any(w is not None for w in groups.windows):
        raise ValueError(
            "--kv-offload-cpu-bytes does not support sliding-window models yet (their "
            "windowed layers keep no full prefix)"
        )
    if size < block_bytes:
        raise ValueError(
            f"--kv-offload-cpu-bytes {config.kv_offload_cpu_bytes} holds no block "
            f"(a block is {block_bytes} bytes)"
        )
    num_blocks = size // block_bytes
    storage = torch.empty(num_blocks * block_bytes, dtype=torch.uint8, pin_memory=pinned)
    return KvCache(num_blocks=num_blocks, device="cpu", storage=storage, **geometry)


def check_features(config: WorkerConfig, model_config: ModelConfig) -> None:
    """Refuse, in one line, a setting the model's architecture does not support yet."""
    for family, present in (
        ("mixture-of-experts", model_config.moe is not None),
        ("latent-attention", model_config.mla is not None),
    ):
        if config.enable_lora and present:
            raise ValueError(
                f"--enable-lora is not supported for {family} models "
                f"({model_config.architecture}) yet"
            )


def check_kv_cache_dtype(config: WorkerConfig, backend: str, device: torch.device) -> None:
    if (
        config.kv_cache_dtype != "auto"
        and backend == "triton"
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device) < (8, 9)
    ):
        raise ValueError(
            "--kv-cache-dtype fp8 with the triton attention backend needs a GPU of compute "
            "capability 8.9 or newer (Triton has no float8_e4m3fn before Ada/Hopper); use "
            "--attention-backend torch on this GPU"
        )


def pack_weights(config: WorkerConfig, model, draft, device, worker_id: str):
    """(bytes, GEMM plan summary) of the CPU packed weights (0, {} where none)."""
    if not wants_packed_weights(config, model, device):
        return 0, {}
    packed_bytes, plan = pack_taking_turns(config, model, device)
    gemm = plan.summary()
    if draft:
        packed_bytes += draft.model.pack_weights(plan)[0]  # measured once, above
    if plan.timings_us:
        log.info("cpu_gemm_measured", worker_id=worker_id, **gemm, us=plan.timings_us)
    return packed_bytes, gemm


def kv_geometry(config: WorkerConfig, model, model_config: ModelConfig, groups, dtype) -> dict:
    """`KvCache`'s arguments but the block count: this rank's layers (their slots:
    `common.kv_groups`) and heads (all of them in a one-process worker)."""
    slots, layer_slots = groups.stage_slots(model.stage.layer_range(model_config.num_hidden_layers))
    return dict(
        block_size=config.block_size,
        num_layers=slots,
        layer_slots=layer_slots,
        num_groups=groups.num_groups,
        num_kv_heads=len(model.shard.kv_heads),
        head_dim=model_config.head_dim,
        dtype=resolve_kv_dtype(config.kv_cache_dtype, dtype),
    )


def kv_pool_bytes(config: WorkerConfig, model, geometry: dict, buckets, max_model_len: int,
                  device) -> tuple[int, dict[str, float]]:  # fmt: skip
    """The KV pool's bytes: `--kv-cache-memory` on CPU; on a GPU this worker's share of its
    memory less a profiled step's activations and the decode graphs (`buckets`: None when
    none are captured), with the sizing in GiB."""
    if device.type != "cuda":
        return parse_size(config.kv_cache_memory), {}
    _release_cuda()
    free, total = torch.cuda.mem_get_info(device)
    # This worker's share: what its own allocator holds (weights so far). Other processes on
    # the same GPU do not count against it, also while they start beside it (a drop in free
    # memory since our start may be theirs).
    used_here = torch.cuda.memory_reserved(device)
    budget = min(int(total * config.gpu_memory_utilization) - used_here, free - CUDA_HEADROOM_BYTES)
    activation = profile_activation_bytes(
        model, geometry, min(config.profile_num_tokens, max_model_len), device
    )
    graph_bytes = (
        measure_graph_bytes(model, geometry, buckets, max_model_len, device)
        if buckets is not None
        else 0
    )
    sizing = {
        "budget_gib": budget / 2**30,
        "activation_gib": activation / 2**30,
        "cuda_graphs_gib": graph_bytes / 2**30,
    }
    return max(0, budget - activation - graph_bytes), sizing


def check_pool_holds_a_request(num_blocks: int, block_size: int, groups, max_model_len: int):
    """A request of max_model_len tokens must fit an empty pool (one prompt chunk may
    need every group's every block before a window trims it)."""
    null = 1 if any(groups.windows) else 0  # the null block (block_manager.py)
    if (num_blocks - null) // groups.num_groups * block_size < max_model_len:
        held = ", one of them the null block of a sliding-window model" if null else ""
        per = f" in each of {groups.num_groups} KV groups" if groups.is_hybrid else ""
        raise ValueError(
            f"the KV pool ({num_blocks} blocks of {block_size} tokens{held}) cannot "
            f"hold one request of max_model_len={max_model_len} tokens{per}: raise "
            f"kv_cache_memory/num_blocks/gpu_memory_utilization or lower max_model_len"
        )


def _block_geometry(geometry: dict) -> dict:
    """`geometry` less what one block's size does not depend on."""
    return {k: v for k, v in geometry.items() if k not in ("layer_slots", "num_groups")}


def kv_groups_for(config: WorkerConfig, model_config: ModelConfig, draft) -> KvGroups:
    """The model's KV groups (`common.kv_groups`): one table per group unless
    --disable-hybrid-kv-cache-manager, or a draft model, whose pool shares the target's
    block ids and holds every draft layer of every block, is loaded (one table)."""
    hybrid = not config.disable_hybrid_kv_cache_manager and draft is None
    return model_config.kv_groups(hybrid)
