"""Lookahead slots in one decoding pool (speculative decoding): how many a step plans, the
blocks they take, accepted proposals catching `num_computed_tokens` up, no second plan
while a verifying step is in flight, a request preempted or swapped with proposals in
flight keeping only what it had, and the counters."""

from services.scheduler.lookahead import Lookahead
from services.scheduler.worker_types import SpecCounts, StepResult
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
        accepted={rid: [(t, None) for t in accepted]},
        spec={rid: SpecCounts(drafts, len(accepted))},
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
    assert s.schedule().is_empty  # its verifying step is in flight: not planned again
    update = s.update(verified("a", [60, 61], 62, 4))
    assert [t.token_id for t in update.tokens] == [60, 61, 62]
    assert r.output_token_ids == [50, 60, 61, 62]
    assert r.num_computed_tokens == 6 + 1 + 2  # the last token is not computed yet
    assert (r.num_draft_tokens, r.num_accepted_tokens) == (4, 2)
    c = s.spec_decode
    assert (c.num_steps, c.num_draft_tokens, c.num_accepted_tokens) == (1, 4, 2)
    assert c.acceptance_rate == 0.5 and c.mean_accepted_length == 3.0
    (item,) = s.schedule().scheduled
    assert item.num_computed_before == 9 and item.num_new_tokens == 1
    s.check_integrity()


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


def test_a_plain_step_in_flight_before_a_verifying_one_does_not_release_it():
    """Async: a plain step in flight, then a verifying step planned behind it. The plain
    step's result must not let the request be planned again before the verifying step's
    result says how far it got."""
    s = sched(lookahead=Lookahead(4))
    r = decoding(s)
    look, s.lookahead = s.lookahead, None
    plain = s.schedule()
    s.lookahead = look
    verifying = s.schedule()
    assert plain.scheduled[0].num_lookahead_tokens == 0
    assert verifying.scheduled[0].num_lookahead_tokens == 4
    s.update(StepResult(0, {"a": 60}, 0.0))  # the plain step's token
    assert s.schedule().is_empty  # still waiting for the verifying step
    s.update(verified("a", [61], 62, 4))
    assert r.output_token_ids == [50, 60, 61, 62] and r.num_computed_tokens == 6 + 2 + 1
    (item,) = s.schedule().scheduled
    assert item.num_computed_before == 9
