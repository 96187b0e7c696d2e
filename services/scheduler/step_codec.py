"""Protobuf conversions of the scheduler's worker protocol: step plans out, step results,
worker descriptions and model shapes in. The only place in the scheduler that builds or
reads worker protobufs besides the gRPC client itself."""

from __future__ import annotations

from dataclasses import asdict, fields

from common.kv_shared_memory import shared_memory_from_pb
from common.pb.tandem.internal.v1 import types_pb2, worker_pb2
from common.sampling_pb import ROLE_FROM_PB, sampling_to_pb
from common.structured_output import constraint_to_pb
from services.scheduler.pool_scheduler import PoolStepPlan
from services.scheduler.request import Request
from services.scheduler.worker_types import (
    ModelShape,
    SpeculativeInfo,
    WorkerInfo,
)


def _worker_sampling(request: Request) -> types_pb2.SamplingParams:
    """The request's sampling as a worker gets it: with the request's stop tokens (the ones
    min_tokens holds back)."""
    message = sampling_to_pb(request.sampling)
    message.stop_token_ids[:] = sorted(request.stop_token_ids)
    return message


def _copies(pairs: list[tuple[int, int]]) -> list[worker_pb2.BlockCopy]:
    return [worker_pb2.BlockCopy(src=src, dst=dst) for src, dst in pairs]


def plan_to_pb(step_id: int, plan: PoolStepPlan) -> worker_pb2.StepRequest:
    message = worker_pb2.StepRequest(
        step_id=step_id,
        cancelled_transfer_tags=plan.cancelled_transfer_tags,
        finished_request_ids=plan.dropped_request_ids,
        swap_out=_copies(plan.swap_out),
        swap_in=_copies(plan.swap_in),
        block_copies=_copies(plan.block_copies),
    )
    for item in plan.scheduled:
        req = item.request
        if item.is_new:
            message.new_requests.append(
                worker_pb2.NewRequest(
                    request_id=req.request_id,
                    token_ids=req.all_token_ids,
                    block_ids=item.new_block_ids,
                    num_computed_tokens=item.num_computed_before,
                    num_scheduled_tokens=item.num_new_tokens,
                    sampling=_worker_sampling(req),
                    num_prompt_tokens=len(req.prompt_token_ids),
                    num_lookahead_tokens=item.num_lookahead_tokens,
                    lora_name=req.lora_name,
                    traceparent=req.trace_context[0],
                    tracestate=req.trace_context[1],
                )
            )
            constraint_to_pb(req.structured, message.new_requests[-1].structured_output)
        else:
            message.cached_requests.append(
                worker_pb2.CachedRequest(
                    request_id=req.request_id,
                    new_block_ids=[] if item.replaced_table else item.new_block_ids,
                    num_scheduled_tokens=item.num_new_tokens,
                    block_table=item.replaced_table or [],
                    num_lookahead_tokens=item.num_lookahead_tokens,
                )
            )
    return message


def model_from_pb(pb: types_pb2.ModelDescription) -> ModelShape:
    """`ModelShape` mirrors `ModelDescription` field for field."""
    values = {f.name: getattr(pb, f.name) for f in fields(ModelShape)}
    return ModelShape(
        **values
        | {"eos_token_ids": tuple(pb.eos_token_ids), "lora_adapters": tuple(pb.lora_adapters)}
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
        shared_memory=(
            shared_memory_from_pb(d.kv_shared_memory) if d.HasField("kv_shared_memory") else None
        ),
        tensor_parallel_size=max(1, d.tensor_parallel_size),
        pipeline_parallel_size=max(1, d.pipeline_parallel_size),
        rank_shared_memory=tuple(shared_memory_from_pb(m) for m in d.rank_kv_shared_memory),
        rank_ucx_addresses=tuple(d.rank_ucx_addresses),
        max_loras=d.max_loras,
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
