"""A `StepRequest` protobuf as the worker's domain types (`StepPlan`): the one decoding of
a plan, used by the gRPC servicer and by the peer ranks of a tensor-parallel worker (which
get the same protobuf bytes from rank 0)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from common.pb.tandem.internal.v1 import worker_pb2
from common.sampling_pb import sampling_from_pb
from common.structured_output import constraint_from_pb
from services.worker.batch import BlockMoves, CachedRequestData, NewRequestData


@dataclass(frozen=True)
class StepPlan:
    step_id: int
    finished_ids: Sequence[str]
    new: Sequence[NewRequestData]
    cached: Sequence[CachedRequestData]
    moves: BlockMoves
    cancelled_transfer_tags: Sequence[int] = ()


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
            swap_out=[(c.src, c.dst) for c in plan.swap_out],
            swap_in=[(c.src, c.dst) for c in plan.swap_in],
            copies=[(c.src, c.dst) for c in plan.block_copies],
        ),
        cancelled_transfer_tags=list(plan.cancelled_transfer_tags),
    )
