"""Proposal slots that pay for themselves (services/scheduler/spec_goodput.py): the step
cost's online fit, the row share a slot must beat, how many slots a request's acceptance
earns (all of them at one stream, none in a full batch of poor proposals, a probe now and
then), a draft model's passes priced in, and the pool scheduler using it."""

import itertools
import random

import pytest

from common.step_result import SpecOutcome, StepResult
from services.scheduler.lookahead import Lookahead
from services.scheduler.spec_goodput import (
    MARGIN,
    PROBE_PERIOD,
    PROBE_PERIOD_MAX,
    DraftCost,
    DraftProbe,
    StepCost,
    acceptance,
    draft_passes,
    worth,
)
from tests.unit.test_pool_scheduler import make_request, sched


def outcome(drafts: int, accepted: list) -> SpecOutcome:
    """`drafts` proposals, of which `accepted` ((token, logprob) pairs) were taken."""
    return SpecOutcome([t for t, _ in accepted], drafts, [e for _, e in accepted])


def fitted(a: float, b: float, noise: float = 0.0, steps: int = 200) -> StepCost:
    rng, cost = random.Random(7), StepCost()
    for _ in range(steps):
        rows = rng.randint(1, 80)
        cost.observe(rows, (a + b * rows) * (1 + rng.uniform(-noise, noise)))
    return cost


def test_the_step_cost_fit_finds_the_line_and_keeps_it_through_steady_batches():
    assert StepCost().bar(16, [0.5] * 16, 4) == 0.0  # nothing fitted: every slot is given
    cost = fitted(0.005, 0.0003)
    a, b = cost.fitted
    assert a == pytest.approx(0.005, rel=1e-6) and b == pytest.approx(0.0003, rel=1e-6)
    assert cost.bar(16, [], 4) == pytest.approx(0.0048 / 0.0098)  # no slot: the plain step
    noisy = fitted(0.005, 0.0003, noise=0.15)
    assert noisy.fitted[1] == pytest.approx(0.0003, rel=0.15)
    for _ in range(500):  # a steady batch: the rows no longer vary, the last fit stays
        cost.observe(16, 0.0098)
    assert cost.fitted[0] == pytest.approx(a, rel=1e-3) and cost.fitted[1] == pytest.approx(
        b, rel=1e-3
    )


def test_the_bar_is_the_best_tokens_per_second_and_slots_must_beat_it():
    cost = fitted(0.005, 0.0003)
    # One stream: rows are nearly free (bar ~0.06): a poor request still speculates.
    assert cost.bar(1, [0.23], 4) < 0.1
    # Sixteen poor requests: no slot beats the plain step's bar (~0.49).
    assert cost.bar(16, [0.23] * 16, 4) == pytest.approx(0.0048 / 0.0098)
    # Sixteen good ones: every slot pays, and the bar rises with the tokens they bring
    # (Dinkelbach: it converges to the best tokens per second times b).
    good = cost.bar(16, [0.94] * 16, 4)
    paid = [j for j in range(1, 5) if 0.94**j > good * MARGIN]  # the slots that beat it
    tokens = 16 * (1 + sum(0.94**j for j in paid))
    assert good == pytest.approx(0.0003 * tokens / (0.005 + 0.0003 * (16 + 16 * len(paid))))
    assert len(paid) >= 3 and good > 0.6

    low, high = make_request("low", 6, 100), make_request("high", 6, 100)
    low.num_draft_tokens, low.num_accepted_tokens = 400, 92  # 0.23
    high.num_draft_tokens, high.num_accepted_tokens = 400, 376  # 0.94
    one = cost.bar(1, [0.23], 4)
    assert worth(low, 4, one, 0.5, 4) == len([j for j in (1, 2, 3) if 0.2327**j > one * MARGIN])
    assert worth(low, 4, one, 0.5, 4) >= 1
    assert worth(high, 4, one, 0.5, 4) == 4
    assert worth(high, 4, good, 0.5, 4) == len(paid)
    full = cost.bar(16, [0.23] * 16, 4)
    low.output_token_ids = [1]  # 7 tokens: not a probe position
    assert worth(low, 4, full, 0.5, 4) == 0
    low.output_token_ids = [1] * (PROBE_PERIOD - 6)  # every PROBE_PERIOD tokens: one probe
    assert worth(low, 4, full, 0.5, 4) == 1
    assert worth(low, 4, 0.0, 0.5, 4) == 4  # no fit yet: all
    assert worth(low, 0, full, 0.5, 4) == 0
    fresh = make_request("fresh", 6, 100)  # no proposals yet: the pool's rate
    assert acceptance(fresh, 0.9) == pytest.approx(0.9)
    assert worth(fresh, 4, full, 0.9, 4) == 4 and worth(fresh, 4, full, 0.2, 4) == 0


def test_the_pool_stops_speculating_for_a_full_batch_of_poor_proposals():
    """Steps of 16 decodes that verify poor proposals teach the pool what a row costs; the
    next steps plan slots only at probe positions. One stream keeps its slots."""
    s = sched(lookahead=Lookahead(4), budget=256, max_seqs=16)
    rids = [f"r{i}" for i in range(16)]
    for rid in rids:
        s.add(make_request(rid, 5, 200))
    s.schedule()
    s.update(StepResult(0, dict.fromkeys(rids, 50), 0.01))
    rng = random.Random(3)
    for _ in range(30):  # every request proposes 4, one in four accepted at most
        plan = s.schedule()
        rows = sum(i.num_new_tokens for i in plan.scheduled)
        drafts = {i.request.request_id: i.num_lookahead_tokens for i in plan.scheduled}
        accepted = {rid: [(51, None)] if rng.random() < 0.25 else [] for rid in drafts}
        spec = {rid: outcome(k, accepted[rid]) for rid, k in drafts.items() if k}
        seconds = 0.005 + 0.0003 * (rows + sum(drafts.values()))
        s.update(
            StepResult(0, dict.fromkeys(drafts, 52), seconds, spec=spec)
        )  # fmt: skip
    plan = s.schedule()
    probes = [i for i in plan.scheduled if i.request.num_tokens % PROBE_PERIOD == 0]
    assert sum(i.num_lookahead_tokens for i in plan.scheduled) == len(probes)
    assert s.slot_policy.step_cost.fitted is not None
    assert s.slot_policy.step_cost.fitted[1] == pytest.approx(0.0003, rel=0.05)
    alone = sched(lookahead=Lookahead(4))
    alone.slot_policy.step_cost = s.slot_policy.step_cost  # the same worker's costs, one request
    request = make_request("solo", 5, 200)
    request.num_draft_tokens, request.num_accepted_tokens = 40, 10
    alone.add(request)
    alone.schedule()
    alone.update(StepResult(0, {"solo": 50}, 0.01))
    (item,) = alone.schedule().scheduled
    assert item.num_lookahead_tokens >= 1


def test_a_draft_pass_is_priced_from_the_steps_that_ran_one():
    cost = DraftCost()
    cost.observe(0, 0.5)  # n-gram steps (no pass) say nothing
    assert cost.seconds_per_pass is None
    cost.observe(4, 0.04)
    assert cost.seconds_per_pass == pytest.approx(0.01)
    for _ in range(50):
        cost.observe(2, 0.01)
    assert cost.seconds_per_pass == pytest.approx(0.005, rel=1e-3)


def test_draft_passes_pay_only_where_the_draft_lands_often_enough_for_its_cost():
    """One stream, a 20 ms step. A draft at half the target's cost per pass that almost
    never lands (0.013: a model's own first half, untrained) gets no pass; the same
    draft at 0.9 gets three (tokens per second: 1 / 20 ms plain; 1.9 / 30, 2.71 / 40,
    3.44 / 50, 4.10 / 60 ms: 63.3, 67.8, 68.8, 68.2); a cheap one (1 ms) pays at 0.5
    too. Without a price (an n-gram proposer, or before any draft step) or any step seen,
    every slot is given. With rows that cost, a slot's row counts as well."""
    step = (0.02, 0.0)
    assert draft_passes(step, 0.01, 1, [0.013], 0.0, 4) == 0
    assert draft_passes(step, 0.01, 1, [0.9], 0.0, 4) == 3
    assert draft_passes(step, 0.001, 1, [0.5], 0.0, 4) >= 2
    assert draft_passes(step, None, 1, [0.013], 0.0, 4) == 4
    assert draft_passes(None, 0.01, 1, [0.013], 0.0, 4) == 4
    # 16 rows at 1 ms a row: 0.6 pays at one stream, not where each slot's row costs too
    assert draft_passes((0.036, 0.0), 0.01, 1, [0.6], 0.0, 4) >= 1
    assert draft_passes((0.02, 0.001), 0.01, 16, [0.6] * 16, 0.0, 4) == 0
    # worth caps a request's slots at the passes; with none, the pool probes, not each
    # request (a probe costs a pass and its draft KV's catching up).
    request = make_request("r", 6, 100)
    request.output_token_ids = [1]
    assert worth(request, 4, 0.0, 0.5, 0) == 0 and worth(request, 4, 0.0, 0.5, 2) == 2
    request.output_token_ids = [1] * (PROBE_PERIOD - 6)
    assert worth(request, 4, 0.0, 0.5, 0) == 0


def test_a_draft_that_keeps_failing_is_probed_ever_more_rarely():
    """The pool's probes of a draft that earns no pass: at once, then after gaps doubling
    from PROBE_PERIOD to PROBE_PERIOD_MAX; a due probe no request took stays due; a step
    whose draft earns passes starts the gaps over; a request's catching up of its draft
    KV must not exceed the steps since the last probe."""
    probe, taken = DraftProbe(), []
    for step in range(40_000):
        if probe.due(step, 0) and step % 7:  # steps divisible by 7 have no decoding row
            probe.probed(step)
            taken.append(step)
    gaps = [b - a for a, b in itertools.pairwise(taken)]
    doubling = [PROBE_PERIOD << i for i in range(6)]
    assert taken[0] == 1 and gaps[:6] == [g + (g % 7 == 0) for g in doubling]
    assert max(gaps) <= PROBE_PERIOD_MAX + 1 and gaps[-1] >= PROBE_PERIOD_MAX
    assert not probe.due(50_000, 2) and not probe.due(50_000 + PROBE_PERIOD - 1, 0)
    assert probe.due(50_000 + PROBE_PERIOD, 0)
    # A request whose draft KV is 300 tokens behind waits until 300 steps have passed.
    probe.probed(60_000)
    assert not probe.affordable(60_299, 300) and probe.affordable(60_300, 300)


def test_a_pool_stops_drafting_when_its_draft_model_seldom_lands():
    """One stream with a draft model whose passes cost half a step and whose proposals
    almost never land: after a few steps the plan gives no slots but at probe positions;
    with proposals that land, the same costs keep all four; with `--speculative-slots all`
    every step gets four, landing or not."""

    def run(accept: bool, goodput: bool = True) -> list[int]:
        s = sched(lookahead=Lookahead(4, goodput=goodput))
        s.add(make_request("solo", 5, 400))
        s.schedule()
        s.update(StepResult(0, {"solo": 50}, 0.02))
        given = []
        for _ in range(40):
            (item,) = s.schedule().scheduled
            k = item.num_lookahead_tokens
            given.append(k)
            hits = k if accept else 0
            s.update(
                StepResult(0, {"solo": 52}, 0.02 + 0.01 * k, propose_seconds=0.01 * k,
                           propose_passes=k,
                           spec={"solo": outcome(k, [(51, None)] * hits)} if k else {})
            )  # fmt: skip
        return given

    poor, good = run(False), run(True)
    assert poor[0] == 4 and sum(poor[-20:]) <= 1  # the probes at most
    assert run(False, goodput=False) == [4] * 40  # --speculative-slots all: no pricing

    # Sixteen streams: the pool probes one request every PROBE_PERIOD steps, not each.
    s = sched(lookahead=Lookahead(4), budget=256, max_seqs=16)
    rids = [f"r{i}" for i in range(16)]
    for i, rid in enumerate(rids):
        s.add(make_request(rid, 5 + i, 400))  # at different token counts
    s.schedule()
    s.update(StepResult(0, dict.fromkeys(rids, 50), 0.02))
    slots = []
    for _ in range(3 * PROBE_PERIOD):
        plan = s.schedule()
        k = {i.request.request_id: i.num_lookahead_tokens for i in plan.scheduled}
        slots.append(sum(k.values()))
        s.update(
            StepResult(0, dict.fromkeys(k, 52), 0.02 + 0.01 * max(k.values()),
                       propose_seconds=0.01 * max(k.values()), propose_passes=max(k.values()),
                       spec={r: outcome(n, []) for r, n in k.items() if n})
        )  # fmt: skip
    assert sum(slots[PROBE_PERIOD:]) <= 2 and max(slots[PROBE_PERIOD:]) <= 1
    assert good[-10:] == [4] * 10
