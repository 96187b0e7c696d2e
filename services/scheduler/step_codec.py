"""Protobuf conversions of worker descriptions and model shapes (a step's plan and result have
theirs in `common/step_plan_pb.py` and `common/step_result_pb.py`)."""

from __future__ import annotations

from dataclasses import asdict, fields

from common.kv_shared_memory import shared_memory_from_pb
from common.pb.tandem.internal.v1 import types_pb2, worker_pb2
from common.sampling_pb import ROLE_FROM_PB
from services.scheduler.worker_types import (
    ModelShape,
    SpeculativeInfo,
    WorkerInfo,
)


def model_from_pb(pb: types_pb2.ModelDescription) -> ModelShape:
    """`ModelShape` mirrors `ModelDescription` field for field."""
    values = {f.name: getattr(pb, f.name) for f in fields(ModelShape)}
    return ModelShape(
        **values
        | {
            "eos_token_ids": tuple(pb.eos_token_ids),
            "lora_adapters": tuple(pb.lora_adapters),
            "kv_group_windows": tuple(pb.kv_group_windows),
        }
    )


def model_to_pb(model: ModelShape) -> types_pb2.ModelDescription:
    return types_pb2.ModelDescription(**asdict(model))


def worker_info_from_pb(address: str, d: worker_pb2.DescribeWorkerResponse) -> WorkerInfo:
    return WorkerInfo(
        worker_id=d.worker_id,
        address=address,
        role=ROLE_FROM_PB[d.role],
        model=model_from_pb(d.model),
        num_blocks=d.kv_cache.num_blocks,
        block_size=d.kv_cache.block_size,
        block_bytes=d.kv_cache.block_bytes,
        ucx_address=d.ucx_address,
        num_swap_blocks=d.kv_cache.num_swap_blocks,
        num_offload_cpu_blocks=d.kv_cache.num_offload_cpu_blocks,
        num_offload_disk_blocks=d.kv_cache.num_offload_disk_blocks,
        offload_disk_hashes=tuple(d.kv_cache.offload_disk_hashes),
        shared_memory=(
            shared_memory_from_pb(d.kv_shared_memory) if d.HasField("kv_shared_memory") else None
        ),
        tensor_parallel_size=max(1, d.tensor_parallel_size),
        pipeline_parallel_size=max(1, d.pipeline_parallel_size),
        rank_shared_memory=tuple(shared_memory_from_pb(m) for m in d.rank_kv_shared_memory),
        rank_ucx_addresses=tuple(d.rank_ucx_addresses),
        max_loras=d.max_loras,
        boot_id=d.boot_id,
        speculative=(
            SpeculativeInfo(
                d.speculative.method,
                d.speculative.num_speculative_tokens,
                d.speculative.disable_by_batch_size,
            )
            if d.HasField("speculative")
            else None
        ),
    )
