"""A `StepPlan` as the `StepRequest` protobuf and back: what the scheduler sends a worker
on its `Step` stream, and what a parallel worker's rank 0 hands its other ranks."""

from __future__ import annotations

from common.kv_shared_memory import shared_memory_from_pb, shared_memory_to_pb
from common.parallel_plan import Layout
from common.pb.tandem.internal.v1 import worker_pb2
from common.sampling_pb import sampling_from_pb, sampling_to_pb
from common.step_plan import (
    BlockMoves,
    CachedRequestData,
    DiskBlock,
    DiskRetain,
    KvLoad,
    KvSource,
    NewRequestData,
    StepPlan,
)
from common.structured_output import constraint_from_pb, constraint_to_pb


def _copies(pairs) -> list[worker_pb2.BlockCopy]:
    return [worker_pb2.BlockCopy(src=src, dst=dst) for src, dst in pairs]


def _pairs(copies) -> list[tuple[int, int]]:
    return [(c.src, c.dst) for c in copies]


def _disk_blocks(blocks) -> list[worker_pb2.DiskBlock]:
    return [
        worker_pb2.DiskBlock(
            block_hash=b.block_hash,
            root=b.root,
            offload_block=b.offload_block,
            retain_until=b.retain_until,
        )
        for b in blocks
    ]


def _disk_blocks_from(blocks) -> list[DiskBlock]:
    return [DiskBlock(b.block_hash, b.root, b.offload_block, b.retain_until) for b in blocks]


def _kv_load_pb(load: KvLoad) -> worker_pb2.KvLoad:
    source, s = None, load.source  # (None: no source field)
    if s is not None:
        source = worker_pb2.KvSource(
            worker_id=s.worker_id,
            shared_memory=shared_memory_to_pb(s.rank_pools[0]),
            block_ids=s.block_ids,
            ready_step_id=s.ready_step_id,
            tensor_parallel_size=s.layout.tp,
            pipeline_parallel_size=s.layout.pp,
            rank_shared_memory=[shared_memory_to_pb(m) for m in s.rank_pools[1:]],
        )
    return worker_pb2.KvLoad(
        transfer_tag=load.tag,
        block_ids=load.block_ids,
        source=source,
        sender_tensor_parallel_size=load.sender_layout.tp,
        sender_pipeline_parallel_size=load.sender_layout.pp,
        traceparent=load.traceparent,
        tracestate=load.tracestate,
    )


def kv_source_from_pb(source: worker_pb2.KvSource) -> KvSource:
    return KvSource(
        worker_id=source.worker_id,
        rank_pools=tuple(
            shared_memory_from_pb(m) for m in (source.shared_memory, *source.rank_shared_memory)
        ),
        block_ids=tuple(source.block_ids),
        ready_step_id=source.ready_step_id,
        layout=Layout(max(1, source.tensor_parallel_size), max(1, source.pipeline_parallel_size)),
    )


def _kv_load_from(load: worker_pb2.KvLoad) -> KvLoad:
    """Layouts are checked where the transfer starts (a bad one fails that load alone)."""
    return KvLoad(
        tag=load.transfer_tag,
        block_ids=tuple(load.block_ids),
        source=kv_source_from_pb(load.source) if load.HasField("source") else None,
        sender_layout=Layout(
            max(1, load.sender_tensor_parallel_size), max(1, load.sender_pipeline_parallel_size)
        ),
        traceparent=load.traceparent,
        tracestate=load.tracestate,
    )


def plan_to_pb(plan: StepPlan) -> worker_pb2.StepRequest:
    message = worker_pb2.StepRequest(
        step_id=plan.step_id,
        cancelled_transfer_tags=plan.cancelled_transfer_tags,
        finished_request_ids=plan.finished_ids,
        swap_out=_copies(plan.moves.swap_out),
        swap_in=_copies(plan.moves.swap_in),
        block_copies=_copies(plan.moves.copies),
        offload_in=_copies(plan.moves.offload_in),
        offload_out=_copies(plan.moves.offload_out),
        disk_saves=_disk_blocks(plan.moves.disk_saves),
        disk_loads=_disk_blocks(plan.moves.disk_loads),
        disk_retains=[
            worker_pb2.DiskRetain(block_hash=r.block_hash, retain_until=r.retain_until)
            for r in plan.moves.disk_retains
        ],
        kv_loads=[_kv_load_pb(load) for load in plan.kv_loads],
        await_kv=plan.await_kv,
    )
    for r in plan.new:
        new = message.new_requests.add(
            request_id=r.request_id,
            token_ids=r.token_ids,
            block_ids=r.block_ids,
            num_computed_tokens=r.num_computed_tokens,
            num_scheduled_tokens=r.num_scheduled_tokens,
            sampling=sampling_to_pb(r.sampling),
            num_prompt_tokens=r.num_prompt_tokens,
            num_lookahead_tokens=r.num_lookahead_tokens,
            lora_name=r.lora_name,
            traceparent=r.traceparent,
            tracestate=r.tracestate,
        )
        constraint_to_pb(r.structured, new.structured_output)
    for r in plan.cached:
        message.cached_requests.add(
            request_id=r.request_id,
            new_block_ids=r.new_block_ids,
            num_scheduled_tokens=r.num_scheduled_tokens,
            block_table=r.block_table,
            num_lookahead_tokens=r.num_lookahead_tokens,
        )
    return message


def plan_from_pb(plan: worker_pb2.StepRequest) -> StepPlan:
    return StepPlan(
        step_id=plan.step_id,
        finished_ids=list(plan.finished_request_ids),
        new=[
            NewRequestData(
                request_id=r.request_id,
                token_ids=r.token_ids,
                block_ids=r.block_ids,
                num_computed_tokens=r.num_computed_tokens,
                num_scheduled_tokens=r.num_scheduled_tokens,
                sampling=sampling_from_pb(r.sampling),
                num_prompt_tokens=r.num_prompt_tokens,
                num_lookahead_tokens=r.num_lookahead_tokens,
                lora_name=r.lora_name,
                structured=constraint_from_pb(r.structured_output),
                traceparent=r.traceparent,
                tracestate=r.tracestate,
            )
            for r in plan.new_requests
        ],
        cached=[
            CachedRequestData(
                r.request_id,
                r.new_block_ids,
                r.num_scheduled_tokens,
                r.block_table,
                r.num_lookahead_tokens,
            )
            for r in plan.cached_requests
        ],
        moves=BlockMoves(
            swap_out=_pairs(plan.swap_out),
            swap_in=_pairs(plan.swap_in),
            copies=_pairs(plan.block_copies),
            offload_in=_pairs(plan.offload_in),
            offload_out=_pairs(plan.offload_out),
            disk_saves=_disk_blocks_from(plan.disk_saves),
            disk_loads=_disk_blocks_from(plan.disk_loads),
            disk_retains=[DiskRetain(r.block_hash, r.retain_until) for r in plan.disk_retains],
        ),
        cancelled_transfer_tags=list(plan.cancelled_transfer_tags),
        kv_loads=[_kv_load_from(load) for load in plan.kv_loads],
        await_kv=plan.await_kv,
    )
