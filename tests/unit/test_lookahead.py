"""Lookahead slots in one decoding pool (speculative decoding): how many a step plans, the
blocks they take, accepted proposals catching `num_computed_tokens` up, the next step
planned while a verifying step is in flight (blocks for the most it can bring, slots capped
as if all were accepted, none when that could end the request), a request preempted or
swapped with proposals in flight keeping only what it had, and the counters."""

from common.step_result import SpecOutcome, StepResult
from services.scheduler.lookahead import Lookahead
from tests.unit.test_pool_scheduler import make_request, sched


def decoding(s, rid="a", prompt_len=6, max_tokens=20):
    """A request whose prompt step ran (one token out, nothing pending)."""
    r = make_request(rid, prompt_len, max_tokens)
    s.add(r)
    plan = s.schedule()
    s.update(StepResult(0, {rid: 50}, 0.0))
    assert [i.num_lookahead_tokens for i in plan.scheduled] == [0]  # a prompt: none
    return r


def verified(rid, accepted, last, drafts):
    return StepResult(
        0,
        {rid: last},
        0.0,
        spec={rid: SpecOutcome(list(accepted), drafts, [None] * len(accepted))},
    )


def test_slots_are_capped_by_max_tokens_the_context_budget_and_batch_size():
    look = Lookahead(4, disable_by_batch_size=8)
    r = make_request("a", 6, max_tokens=5)
    r.output_token_ids = [1, 2]
    assert look.slots(r, budget=100, batch_size=1) == 2  # emits at most 3 more
    assert look.slots(r, budget=1, batch_size=1) == 1
    assert look.slots(r, budget=100, batch_size=8) == 0
    r.max_model_len = 9  # 8 tokens known: one more fits
    assert look.slots(r, budget=100, batch_size=1) == 0
    assert Lookahead(4).slots(make_request("b", 3, 50), 100, 1000) == 4


def test_accepted_proposals_catch_up_and_the_blocks_cover_the_slots():
    s = sched(lookahead=Lookahead(4))
    r = decoding(s)
    plan = s.schedule()
    (item,) = plan.scheduled
    assert (item.num_new_tokens, item.num_lookahead_tokens) == (1, 4)
    assert len(s.blocks.table("a")) * 4 >= 7 + 4  # the known tokens and every slot
    assert r.num_lookahead_in_flight == 4
    # Planned again before the verifying step's result: one token (the one it samples)
    # wherever the worker's copy ends, blocks for all 4 proposals accepted, 4 new slots.
    (ahead,) = s.schedule().scheduled
    assert (ahead.num_new_tokens, ahead.num_lookahead_tokens) == (1, 4)
    assert len(s.blocks.table("a")) * 4 >= 7 + 4 + 1 + 4
    assert r.num_lookahead_in_flight == 8
    update = s.update(verified("a", [60, 61], 62, 4))
    assert [t.token_id for t in update.tokens] == [60, 61, 62]
    assert r.output_token_ids == [50, 60, 61, 62]
    assert r.num_computed_tokens == 6 + 1 + 2 + 1  # the step planned ahead computes 62
    assert r.num_lookahead_in_flight == 4
    assert (r.num_draft_tokens, r.num_accepted_tokens) == (4, 2)
    c = s.spec_decode
    assert (c.num_steps, c.num_draft_tokens, c.num_accepted_tokens) == (1, 4, 2)
    assert c.acceptance_rate == 0.5 and c.mean_accepted_length == 3.0
    s.update(verified("a", [], 63, 4))
    assert r.output_token_ids == [50, 60, 61, 62, 63] and r.num_lookahead_in_flight == 0
    (item,) = s.schedule().scheduled
    assert item.num_computed_before == 10 and item.num_new_tokens == 1
    s.check_integrity()


def test_proposals_in_flight_that_could_end_the_request_hold_its_next_step():
    s = sched(lookahead=Lookahead(4))
    r = decoding(s, max_tokens=7)  # 1 out: the verifying step may bring 5 more
    (item,) = s.schedule().scheduled
    assert item.num_lookahead_tokens == 4
    # All accepted would make 6 of 7: one more token fits, with no slot.
    (ahead,) = s.schedule().scheduled
    assert (ahead.num_new_tokens, ahead.num_lookahead_tokens) == (1, 0)
    s.update(verified("a", [60], 61, 4))  # the first step brought 2, not 5
    s.update(StepResult(0, {"a": 62}, 0.0))
    assert r.output_token_ids == [50, 60, 61, 62]
    (item,) = s.schedule().scheduled
    assert item.num_lookahead_tokens == 2  # 3 more may come: 1 + 2 slots
    assert s.schedule().is_empty  # all accepted would end it: wait for the result
    assert Lookahead.can_plan_ahead(r) is False


def test_a_stop_token_among_the_accepted_ones_ends_the_request_there():
    s = sched(lookahead=Lookahead(4))
    r = decoding(s)
    r.stop_token_ids = frozenset({61})
    s.schedule()
    update = s.update(verified("a", [60, 61, 70], 71, 4))
    assert r.output_token_ids == [50, 60, 61]
    assert update.finished == [r] and not s.blocks.has("a")


def test_a_preempted_request_keeps_only_what_it_had():
    s = sched(lookahead=Lookahead(4))
    r = decoding(s)
    s.schedule()
    s.running.remove(r)  # as _preempt does (recompute): blocks freed, computed reset
    s.blocks.free("a")
    r.num_computed_tokens = 0
    s.update(verified("a", [60, 61], 62, 4))
    assert r.output_token_ids == [50, 60, 61, 62]  # the tokens are right
    assert r.num_computed_tokens == 0  # their KV went with the blocks


def test_a_plain_step_in_flight_before_a_verifying_one_keeps_its_slots_counted():
    """Async: a plain step in flight, then a verifying step planned behind it: the plain
    step's result leaves the verifying step's slots counted until its own result."""
    s = sched(lookahead=Lookahead(4))
    r = decoding(s)
    look, s.lookahead = s.lookahead, None
    plain = s.schedule()
    s.lookahead = look
    verifying = s.schedule()
    assert plain.scheduled[0].num_lookahead_tokens == 0
    assert verifying.scheduled[0].num_lookahead_tokens == 4
    s.update(StepResult(0, {"a": 60}, 0.0))  # the plain step's token
    assert r.num_lookahead_in_flight == 4
    s.update(verified("a", [61], 62, 4))
    assert r.output_token_ids == [50, 60, 61, 62] and r.num_computed_tokens == 6 + 2 + 1
    assert r.num_lookahead_in_flight == 0
    (item,) = s.schedule().scheduled
    assert item.num_computed_before == 9
