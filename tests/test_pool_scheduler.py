"""Continuous batching in one pool: budget, chunking, admission, preemption, drops."""

import pytest

from services.scheduler.block_manager import BlockManager
from services.scheduler.pool_scheduler import PoolScheduler
from services.scheduler.request import FinishReason, Request


def make_request(rid: str, prompt_len: int, max_tokens: int = 8) -> Request:
    return Request(
        request_id=rid, prompt_token_ids=list(range(1, prompt_len + 1)), max_tokens=max_tokens
    )


def sched(num_blocks=64, block_size=4, budget=32, max_seqs=8) -> PoolScheduler:
    return PoolScheduler(BlockManager(num_blocks, block_size), budget, max_seqs)


def step(s: PoolScheduler, sample: int = 7):
    """Plan a step and feed back a token for every request that caught up."""
    plan = s.schedule()
    for item in plan.scheduled:
        r = item.request
        if r.num_computed_tokens == r.num_tokens:
            r.append_token(sample)
    return plan


def test_prompt_is_chunked_under_the_token_budget_and_blocks_grow_with_it():
    s = sched(budget=6)
    r = make_request("a", 14)
    s.add(r)
    plan = step(s)
    (item,) = plan.scheduled
    assert (item.is_new, item.num_new_tokens, item.num_computed_before) == (True, 6, 0)
    assert item.new_block_ids == s.blocks.table("a") and len(item.new_block_ids) == 2
    plan = step(s)
    (item,) = plan.scheduled
    assert (item.is_new, item.num_new_tokens, item.num_computed_before) == (False, 6, 6)
    assert len(item.new_block_ids) == 1  # tokens 6..11 need block 2 only
    plan = step(s)
    assert plan.scheduled[0].num_new_tokens == 2
    assert r.output_token_ids == [7]  # sampled only after the last chunk
    plan = step(s)
    assert plan.scheduled[0].num_new_tokens == 1  # now decoding


def test_running_requests_go_first_and_waiting_ones_join_in_order():
    s = sched(budget=10)
    a, b, c = make_request("a", 8), make_request("b", 8), make_request("c", 8)
    for r in (a, b, c):
        s.add(r)
    plan = step(s)
    assert [(i.request.request_id, i.num_new_tokens) for i in plan.scheduled] == [
        ("a", 8),
        ("b", 2),
    ]
    plan = step(s)
    # a decodes (1), b finishes its prompt (6), c starts with what is left (3).
    assert [(i.request.request_id, i.num_new_tokens) for i in plan.scheduled] == [
        ("a", 1),
        ("b", 6),
        ("c", 3),
    ]


def test_max_num_seqs_caps_the_running_batch():
    s = sched(max_seqs=2)
    for i in range(3):
        s.add(make_request(str(i), 2))
    plan = step(s)
    assert len(plan.scheduled) == 2
    assert len(s.waiting) == 1


def test_finished_request_is_released_and_dropped_on_the_next_plan():
    s = sched()
    r = make_request("a", 3, max_tokens=1)
    s.add(r)
    step(s)
    assert r.finish_reason is FinishReason.LENGTH
    freed = s.release(r)
    assert freed == 1 and s.blocks.num_free_blocks == s.blocks.num_blocks
    plan = s.schedule()
    assert plan.dropped_request_ids == ["a"] and not plan.scheduled
    assert s.schedule().dropped_request_ids == []


def test_newest_running_request_is_preempted_when_blocks_run_out():
    s = sched(num_blocks=4, block_size=4, budget=64)
    a, b = make_request("a", 8, max_tokens=20), make_request("b", 7, max_tokens=20)
    s.add(a)
    s.add(b)
    step(s)  # a: 2 blocks (8 tokens), b: 2 blocks (7 tokens); pool full
    assert s.blocks.num_free_blocks == 0
    plan = step(s)
    # a needs a third block for its 9th token: b (newest) is preempted, a runs.
    assert [p.request_id for p in plan.preempted] == ["b"]
    assert [i.request.request_id for i in plan.scheduled] == ["a"]
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert plan.dropped_request_ids == ["b"]
    assert not s.holds(b)  # the caller re-queues it
    s.blocks.check_integrity()


def test_lone_request_that_cannot_grow_preempts_itself():
    s = sched(num_blocks=2, block_size=4, budget=64)
    a = make_request("a", 8, max_tokens=4)
    s.add(a)
    step(s)
    plan = step(s)
    assert plan.preempted == [a] and not plan.scheduled
    assert s.blocks.num_free_blocks == 2


def test_waiting_requests_holding_blocks_yield_when_nothing_runs():
    # Decode-pool situation: requests arrive with received KV already in blocks.
    s = sched(num_blocks=4, block_size=4, budget=64)
    a, b = make_request("a", 7), make_request("b", 8)
    for r in (a, b):
        r.append_token(5)  # first token came from the prefill worker
        r.num_computed_tokens = r.num_tokens - 1
        s.blocks.allocate(r.request_id, r.num_computed_tokens)
        s.add(r)
    assert s.blocks.num_free_blocks == 0
    plan = s.schedule()
    # a fits (7 + 1 tokens in its 2 blocks); b needs a third block and nothing is free,
    # but a runs and will free blocks later: b waits rather than being preempted.
    assert [i.request.request_id for i in plan.scheduled] == ["a"]
    assert not plan.preempted


def test_waiting_holder_is_preempted_when_the_head_cannot_start_and_nothing_runs():
    s = sched(num_blocks=4, block_size=4, budget=64)
    a, b = make_request("a", 8), make_request("b", 8)
    for r in (a, b):
        r.append_token(5)
        r.num_computed_tokens = r.num_tokens - 1
        s.blocks.allocate(r.request_id, r.num_computed_tokens)
        s.add(r)
    assert s.blocks.num_free_blocks == 0  # a needs a third block for its 10th token
    plan = s.schedule()
    assert plan.preempted == [b]
    assert [i.request.request_id for i in plan.scheduled] == ["a"]


def test_budget_and_caps_are_validated():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        PoolScheduler(BlockManager(4, 4), 0, 1)
    with pytest.raises(ValueError, match="max_num_seqs"):
        PoolScheduler(BlockManager(4, 4), 1, 0)


def test_request_finishes_on_stop_token_and_max_tokens():
    r = Request("a", [1, 2], max_tokens=3, stop_token_ids=frozenset({9}))
    assert r.append_token(4) is None
    assert r.append_token(9) is FinishReason.STOP
    r2 = Request("b", [1], max_tokens=2)
    r2.append_token(1)
    assert r2.append_token(1) is FinishReason.LENGTH
    r3 = Request("c", [1, 2, 3], max_tokens=10, max_model_len=4)
    assert r3.append_token(1) is FinishReason.LENGTH


def test_head_that_cannot_start_does_not_preempt_requests_without_blocks():
    # Prefill-pool situation: blocks are held outside the queues (requests handed off to
    # decode); waiting requests hold none, so preempting them would free nothing.
    s = sched(num_blocks=2, block_size=4, budget=64)
    s.blocks.allocate("handed-off", 8)
    for i in range(3):
        s.add(make_request(str(i), 4))
    plan = s.schedule()
    assert plan.is_empty and not plan.preempted
    assert len(s.waiting) == 3
