"""Beam search's bookkeeping on a real `PoolScheduler` and `BlockManager` (no worker: step
results are made by hand): new beams are new requests sharing their parents' blocks, only
their new token is computed, a shared partial block is copied once on write, a beam is
never planned ahead of its result nor while it waits for its group, old beams are freed at
once, and every block is free when the search ends or is reset."""

from __future__ import annotations

import pytest

from common.sampling import Logprob, SamplingParams
from common.step_result import StepResult
from services.scheduler.beam_group import BeamGroup
from services.scheduler.beam_search import BeamParams
from services.scheduler.block_manager import BlockManager
from services.scheduler.pool_scheduler import PoolScheduler
from services.scheduler.request import Request

PROMPT = [1, 2, 3, 4, 5]  # block size 4: one full block and one partial one
EOS = 9


def setup(width=2, max_new=3, n=2, max_num_seqs=16):
    blocks = BlockManager(num_blocks=32, block_size=4)
    scheduler = PoolScheduler(blocks, max_num_batched_tokens=64, max_num_seqs=max_num_seqs)
    leader = Request("r", list(PROMPT), max_tokens=max_new)
    params = BeamParams(
        beam_width=width,
        eos_token_ids=(EOS,),
        max_new_tokens=max_new,
        num_return_sequences=n,
        prompt_len=len(PROMPT),
    )
    group = BeamGroup(leader, params)
    leader.sampling = SamplingParams(logprobs=group.search.candidates_needed())
    scheduler.add(leader)
    return blocks, scheduler, group


_steps = iter(range(1, 1000))


def result(requests, tops) -> StepResult:
    """A step result: each request's worker pick (its best token) and its candidates."""
    return StepResult(
        next(_steps),
        {r.request_id: top[0][0] for r, top in zip(requests, tops, strict=True)},
        0.0,
        logprobs={
            r.request_id: Logprob(top[0][0], top[0][1], tuple(top))
            for r, top in zip(requests, tops, strict=True)
        },
    )


def apply(scheduler, blocks, group, update):
    """What the engine does with a step's update (BeamSteps._beam_token / _beam_step):
    the results when the search is done (then every beam is released), else None."""
    for item in update.tokens:
        if group.record(item.request, item.logprob.top, scheduler):
            children, parents, done = group.step(blocks)
            for parent in parents:
                group.release(scheduler, parent)
            if done:
                results = group.results()
                group.reset(scheduler)
                return results
            for child in reversed(children):
                scheduler.add(child, front=True)
    return None


def tops(*tokens):
    return [(t, -0.1 * (i + 1)) for i, t in enumerate(tokens)]


def test_beams_fork_copy_on_write_and_free_everything():
    blocks, scheduler, group = setup()
    plan = scheduler.schedule()
    assert [s.num_new_tokens for s in plan.scheduled] == [5]
    leader = group.leader
    update = scheduler.update(result([leader], [tops(7, 8, 6, 5)]))
    assert not apply(scheduler, blocks, group, update)
    beams = group.beams
    assert [b.request_id for b in beams] == ["r#1.0", "r#1.1"]
    assert [b.all_token_ids for b in beams] == [PROMPT + [7], PROMPT + [8]]
    assert all(b.num_computed_tokens == 5 for b in beams)
    assert not blocks.has("r")  # the leader is freed at once

    plan = scheduler.schedule()
    assert [(s.request.request_id, s.is_new, s.num_computed_before) for s in plan.scheduled] == [
        ("r#1.0", True, 5),
        ("r#1.1", True, 5),
    ]
    assert "r" in plan.dropped_request_ids
    assert len(plan.block_copies) == 1  # the shared partial block, copied once
    t0, t1 = (blocks.table(b.request_id) for b in beams)
    assert t0[0] == t1[0] and t0[1] != t1[1]  # the full prompt block stays shared
    assert scheduler.schedule().is_empty  # never planned ahead of its result

    update = scheduler.update(result(beams, [tops(3, 4, 6, 5), tops(EOS, 4, 2, 5)]))
    assert not apply(scheduler, blocks, group, update)
    assert all(not blocks.has(b.request_id) for b in beams)  # old beams freed
    assert {b.request_id for b in group.beams} <= {"r#2.0", "r#2.1"}
    plan = scheduler.schedule()
    assert len(plan.scheduled) == 2
    assert {b.request_id for b in beams} <= set(plan.dropped_request_ids)
    live = group.beams
    update = scheduler.update(result(live, [tops(1, 2, 3, 4), tops(2, 1, 3, 4)]))
    results = apply(scheduler, blocks, group, update)  # max_new_tokens reached
    assert blocks.num_free_blocks == blocks.num_blocks
    blocks.check_integrity()
    assert [r.tokens for r in results] == [(7, 3, 1), (7, 3, 2)]


def test_a_beam_with_its_result_waits_out_of_the_batch_for_its_group():
    """max_num_seqs=1 < width: beams run one per step; one whose candidates are in leaves
    the batch (keeping its blocks) so the next can run, and is never planned meanwhile."""
    blocks, scheduler, group = setup(max_num_seqs=1)
    scheduler.schedule()
    update = scheduler.update(result([group.leader], [tops(7, 8, 6, 5)]))
    apply(scheduler, blocks, group, update)
    first, second = group.beams
    plan = scheduler.schedule()
    assert [s.request for s in plan.scheduled] == [first]
    update = scheduler.update(result([first], [tops(3, 4, 6, 5)]))
    assert not apply(scheduler, blocks, group, update)
    assert first.held and blocks.has(first.request_id)
    plan = scheduler.schedule()
    assert [s.request for s in plan.scheduled] == [second]
    assert first.request_id in plan.dropped_request_ids
    update = scheduler.update(result([second], [tops(2, 4, 6, 5)]))
    assert not apply(scheduler, blocks, group, update)
    assert not blocks.has(first.request_id) and not blocks.has(second.request_id)
    assert [b.all_token_ids[-2:] for b in group.beams] == [[7, 3], [7, 4]]
    group.reset(scheduler)
    assert blocks.num_free_blocks == blocks.num_blocks


def test_reset_frees_every_beam_and_starts_over():
    blocks, scheduler, group = setup(width=4, max_new=5, n=1)
    scheduler.schedule()
    update = scheduler.update(result([group.leader], [tops(7, 8, 6, 5, 4, 3, 2, 1)]))
    apply(scheduler, blocks, group, update)
    assert len(group.beams) == 4
    scheduler.schedule()
    old = list(group.beams)
    group.reset(scheduler)
    assert all(b.is_finished for b in old)  # their late results are dropped
    assert blocks.num_free_blocks == blocks.num_blocks
    assert group.leader.output_token_ids == [] and group.search.num_steps == 0
    late = scheduler.update(result(old, [tops(1, 2, 3, 4, 5, 6, 7, 8)] * 4))
    assert late.tokens == []


def test_stale_candidates_are_ignored():
    _, scheduler, group = setup()
    stranger = Request("x", [1, 2], max_tokens=2)
    assert not group.record(stranger, tops(1, 2, 3, 4), scheduler)
    with pytest.raises(RuntimeError):
        group.step(BlockManager(num_blocks=4, block_size=4))
