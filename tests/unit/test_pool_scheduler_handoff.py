"""Requests and blocks leaving or entering a pool: KV loads from peers ride in its plans
(an idle pool's plan awaits them) and end with its step results; a cancelled load holds its
blocks until a plan carries its tag (or the worker is lost); and a draining decode pool
hands its requests on with their KV once no step in flight computes for them."""

import asyncio

import pytest

from common.step_plan import DiskBlock, KvLoad
from common.step_result import KvLoadDone
from services.scheduler.step_plan import PoolStepPlan
from services.scheduler.worker_types import StepResult, WorkerUnavailableError
from tests.unit.test_pool_scheduler import (
    arrived,
    make_request,
    result_for,
    sched,
    scheduled,
    step,
    swap_sched,
)


def test_blocks_of_a_cancelled_receive_are_held_until_a_step_carries_its_tag():
    async def run():
        s = sched(num_blocks=4, block_size=4)
        s.blocks.allocate("moving", 12)  # a receive into three blocks, then given up
        s.peer_loads.start(KvLoad(0xAB, s.blocks.table("moving")))
        assert s.schedule().kv_loads  # sent: it may run on the worker now
        s.update(StepResult(step_id=1, sampled={}, execute_seconds=0.0))
        s.peer_loads.cancel(0xAB, "moving")
        assert not s.blocks.has("moving") and s.blocks.num_free_blocks == 1  # still held
        plan = s.schedule()  # nothing runs, yet the tag must reach the worker
        assert not plan.is_empty and plan.cancelled_transfer_tags == [0xAB]
        assert not plan.await_kv and plan.kv_loads == []
        assert s.blocks.num_free_blocks == 4 and s.blocks.num_requests == 0
        s.update(StepResult(step_id=2, sampled={}, execute_seconds=0.0))
        assert s.schedule().is_empty

    asyncio.run(run())


def test_a_load_cancelled_before_any_plan_carried_it_is_never_sent_and_frees_at_once():
    async def run():
        s = sched(num_blocks=4, block_size=4)
        s.blocks.allocate("moving", 12)
        outcome = s.peer_loads.start(KvLoad(0xAC, s.blocks.table("moving")))
        s.peer_loads.cancel(0xAC, "moving")  # e.g. a deadline while both steps were in flight
        assert outcome.cancelled() and s.blocks.num_free_blocks == 4
        plan = s.schedule()
        assert plan.kv_loads == [] and not plan.await_kv

    asyncio.run(run())


def test_a_lost_worker_fails_its_loads_and_frees_blocks_held_for_cancelled_ones():
    async def run():
        s = sched(num_blocks=4, block_size=4)
        s.blocks.allocate("moving", 8)
        s.blocks.allocate("loading", 4)
        s.peer_loads.cancel(7, "moving")
        outcome = s.peer_loads.start(KvLoad(8, s.blocks.table("loading")))
        s.peer_loads.fail_all(WorkerUnavailableError("gone"))
        with pytest.raises(WorkerUnavailableError):
            await outcome
        s.blocks.free("loading")
        assert s.blocks.num_free_blocks == 4 and s.schedule().is_empty

    asyncio.run(run())


def test_a_load_rides_in_the_next_plan_and_an_idle_pool_awaits_its_outcome():
    async def run():
        s = sched(num_blocks=8, block_size=4)
        s.blocks.allocate("moving", 8)
        load = KvLoad(0x51, s.blocks.table("moving"))
        outcome = s.peer_loads.start(load)
        assert s.peer_loads.pending
        first = s.schedule()  # nothing else runs: the plan carries the load and awaits it
        assert first.kv_loads == [load] and not first.is_empty
        worker_plan = first.worker_plan(1)
        assert worker_plan.kv_loads == [load] and worker_plan.await_kv
        assert not s.peer_loads.pending
        assert s.schedule().is_empty  # a step in flight: no second await plan
        s.update(StepResult(1, {}, 0.0))  # answered with no load ended yet
        assert not outcome.done()
        again = s.schedule()  # idle again, the load still runs: await it again
        assert again.await_kv and again.kv_loads == [] and not again.is_empty
        done = KvLoadDone(0x51, num_bytes=512)
        s.update(StepResult(2, {}, 0.0, kv_loads_done=(done, KvLoadDone(0x99))))  # 0x99: unknown
        assert await outcome == done
        assert s.schedule().is_empty  # nothing left to await

    asyncio.run(run())


def test_a_cancelled_load_is_no_longer_awaited_and_its_late_outcome_is_dropped():
    async def run():
        s = sched(num_blocks=8, block_size=4)
        s.blocks.allocate("moving", 8)
        outcome = s.peer_loads.start(KvLoad(0x52, s.blocks.table("moving")))
        s.schedule()
        s.update(StepResult(1, {}, 0.0))
        s.peer_loads.cancel(0x52, "moving")
        assert outcome.cancelled()
        plan = s.schedule()
        assert plan.cancelled_transfer_tags == [0x52] and not plan.await_kv
        s.update(StepResult(2, {}, 0.0, kv_loads_done=(KvLoadDone(0x52, error="cancelled"),)))
        assert s.blocks.num_free_blocks == 8 and s.schedule().is_empty

    asyncio.run(run())


def test_a_plan_whose_result_is_awaited_never_asks_the_worker_to_wait():
    async def run():
        s = sched(num_blocks=16, block_size=4)
        s.blocks.allocate("moving", 4)
        s.peer_loads.start(KvLoad(0x53, s.blocks.table("moving")))
        s.add(make_request("r", 5))
        plan = s.schedule()
        assert scheduled(plan) == [("r", 5)] and plan.kv_loads
        assert not plan.worker_plan(1).await_kv
        # Nor one with disk reads: a request may be waiting for their outcome.
        reads = PoolStepPlan(await_kv=True, disk_loads=[DiskBlock(b"h" * 32, b"r" * 32, 0)])
        assert not reads.worker_plan(2).await_kv
        assert PoolStepPlan(await_kv=True).worker_plan(3).await_kv

    asyncio.run(run())


# -- a draining decode pool hands its requests on with their KV ------------------------------
def test_a_draining_pool_hands_a_request_on_only_once_no_step_in_flight_computes_for_it():
    s = sched()
    a, b = arrived(s, "a", 6), arrived(s, "b", 6, first=50)
    first, second = s.schedule(), s.schedule()  # async: two decode steps in flight
    assert scheduled(second) == [("a", 1), ("b", 1)]
    s.migrating = True
    assert s.take_migrations() == [] and s.schedule().is_empty  # nothing new runs
    assert s.update(result_for(first)).ready_for_handoff == []  # `second` computes for them
    update = s.update(result_for(second, token=9))
    assert update.ready_for_handoff == [a, b] and s.num_migrations_out == 2
    for r in (a, b):  # out of the queues, KV kept; the next pool computes one token
        assert r.output_token_ids == [5, 7, 9] and r.num_pending_tokens == 0
        assert r.num_computed_tokens == r.num_known_tokens - 1 == 8
        assert not s.holds(r) and s.blocks.table(r.request_id) and not r.is_finished
    assert s.schedule().is_empty  # both stay in the worker's batch while their KV moves
    s.blocks.free("a")  # a's KV arrived elsewhere
    assert s.schedule().dropped_request_ids == ["a"]
    s.blocks.free("b")
    assert s.schedule().dropped_request_ids == ["b"]
    assert s.blocks.num_free_blocks == s.blocks.num_blocks
    s.check_integrity()


def test_a_draining_pool_finishes_last_tokens_and_hands_on_kv_that_arrived_late():
    s = sched()
    done = arrived(s, "done", 6, max_tokens=2)
    plan = s.schedule()  # samples done's last token
    s.migrating = True
    late = arrived(s, "late", 6, first=50)  # its transfer ended after the drain began
    assert s.take_migrations() == [late]
    update = s.update(result_for(plan))
    assert update.finished == [done] and update.ready_for_handoff == []
    assert not s.blocks.has("done") and s.blocks.has("late")
    s.blocks.free("late")
    assert s.schedule().dropped_request_ids == ["done"]  # late never reached the worker


def test_a_move_called_off_leaves_the_request_running_where_the_worker_still_holds_it():
    s = sched()
    a = arrived(s, "a", 6)
    s.update(result_for(s.schedule()))
    s.migrating = True
    assert s.take_migrations() == [a]
    s.migrating = False  # the drain ended before a decode pool pulled it
    s.take_back(a)
    plan = s.schedule()
    (item,) = plan.scheduled
    assert (item.request, item.is_new, item.num_new_tokens) == (a, False, 1)
    assert plan.dropped_request_ids == [] and s.num_migrations_out == 1


def test_a_draining_pool_swaps_a_swapped_request_back_in_for_one_step_then_hands_it_on():
    s = swap_sched()
    a, b = make_request("a", 8, max_tokens=8), make_request("b", 7, max_tokens=8, first=50)
    s.add(a)
    s.add(b)
    step(s)
    assert step(s).swapped_out == [b]
    s.migrating = True
    assert s.take_migrations() == [a]  # b's KV is in swap space
    s.blocks.free("a")  # a's KV moved: room for b
    plan = s.schedule()
    assert plan.swap_in and scheduled(plan) == [("b", 1)] and plan.dropped_request_ids == ["a"]
    assert s.update(result_for(plan)).ready_for_handoff == [b]
    assert s.blocks.has("b") and not s.swap_blocks.has("b")
