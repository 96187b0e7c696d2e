"""A step's plan keeps one shape from the pool scheduler to the worker: the entries
`PoolScheduler.schedule()` makes are the ones the worker decodes from the wire, new and
cached requests, replaced tables, block moves and cancelled tags alike."""

from __future__ import annotations

import dataclasses
from dataclasses import replace

from common.kv_shared_memory import SharedMemoryInfo
from common.parallel_plan import Layout
from common.pb.tandem.internal.v1 import worker_pb2
from common.sampling import SamplingParams
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
from common.step_plan_pb import plan_from_pb, plan_to_pb
from common.structured_output import Constraint
from tests.unit.test_pool_scheduler import make_request, result_for, sched


def _lists(plan: StepPlan) -> StepPlan:
    """The plan with every sequence a list (the wire gives protobuf containers back)."""
    return replace(
        plan,
        finished_ids=list(plan.finished_ids),
        new=[
            replace(n, token_ids=list(n.token_ids), block_ids=list(n.block_ids)) for n in plan.new
        ],
        cached=[
            replace(c, new_block_ids=list(c.new_block_ids), block_table=list(c.block_table))
            for c in plan.cached
        ],
        moves=BlockMoves(
            *(list(getattr(plan.moves, f.name)) for f in dataclasses.fields(BlockMoves))
        ),
        cancelled_transfer_tags=list(plan.cancelled_transfer_tags),
        kv_loads=list(plan.kv_loads),
    )


def _through_the_wire(plan: StepPlan) -> StepPlan:
    wire = worker_pb2.StepRequest.FromString(plan_to_pb(plan).SerializeToString())
    return _lists(plan_from_pb(wire))


def test_the_pool_schedulers_entries_are_what_the_worker_decodes():
    s = sched()
    first = make_request("a", 6, 8)
    first.sampling = SamplingParams(temperature=0.5, min_tokens=2, seed=3, logprobs=2)
    first.stop_token_ids = frozenset({9, 4})
    first.structured = Constraint("regex", "[a-z]+")
    first.trace_context = ("00-" + "1" * 32 + "-" + "2" * 16 + "-01", "k=v")
    s.add(first)
    plan = s.schedule()
    worker_plan = plan.worker_plan(1)
    (new,) = worker_plan.new
    assert new is plan.scheduled[0].work  # the entry itself, not a copy made for the wire
    assert new.sampling.stop_token_ids == (4, 9) and new.traceparent.startswith("00-")
    assert _through_the_wire(worker_plan) == _lists(worker_plan)
    s.update(result_for(plan))
    s.add(make_request("b", 3, 8))
    plan = s.schedule()
    worker_plan = plan.worker_plan(2)
    assert [c.request_id for c in worker_plan.cached] == ["a"]
    assert [n.request_id for n in worker_plan.new] == ["b"]
    assert _through_the_wire(worker_plan) == _lists(worker_plan)


def test_moves_replaced_tables_and_cancelled_tags_cross_unchanged():
    plan = StepPlan(
        step_id=7,
        finished_ids=["x"],
        new=[NewRequestData("n", [1, 2, 3], [4], 0, 3, SamplingParams(top_k=5))],
        cached=[CachedRequestData("c", (), 1, (8, 0, 9), 2)],
        moves=BlockMoves(
            [(1, 2)],
            [(3, 4)],
            [(7, 8)],
            [(5, 6)],
            [(9, 10)],
            disk_saves=[DiskBlock(b"s" * 32, b"r" * 32, 3, 1_800_000_000.5)],
            disk_loads=[DiskBlock(b"l" * 32, b"r" * 32, 4)],
            disk_retains=[DiskRetain(b"k" * 32, 1_800_000_060.25)],
        ),
        cancelled_transfer_tags=[11, 12],
    )
    assert _through_the_wire(plan) == _lists(plan)
    assert plan_from_pb(plan_to_pb(plan)).moves.disk_retains == plan.moves.disk_retains


def test_kv_loads_cross_unchanged_with_their_source_layouts_and_trace():
    pool = SharedMemoryInfo("host-a", 41, 7, 1 << 20, b"t" * 16)
    rank1 = SharedMemoryInfo("host-a", 42, 8, 1 << 20, b"u" * 16, pool_offset=8192)
    pull = KvLoad(
        0xFFFF_0000_0000_0001,
        (3, 4, 5),
        KvSource("p0", (pool, rank1), (9, 10, 11), ready_step_id=12, layout=Layout(2)),
        traceparent="00-" + "a" * 32 + "-" + "b" * 16 + "-01",
        tracestate="k=v",
    )  # fmt: skip
    ucx = KvLoad(7, (1,), sender_layout=Layout(2, 2))
    plan = StepPlan(3, [], [], [], BlockMoves(), kv_loads=[pull, ucx], await_kv=True)
    assert _through_the_wire(plan) == _lists(plan)
