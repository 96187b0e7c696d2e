"""A `StepPlan` as the `StepRequest` protobuf and back: what the scheduler sends a worker
on its `Step` stream, and what a parallel worker's rank 0 hands its other ranks."""

from __future__ import annotations

from common.pb.tandem.internal.v1 import worker_pb2
from common.sampling_pb import sampling_from_pb, sampling_to_pb
from common.step_plan import (
    BlockMoves,
    CachedRequestData,
    DiskBlock,
    DiskRetain,
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
    )
