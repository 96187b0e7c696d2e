"""Whether a proposal slot pays for itself, step by step (speculative decoding that is never
slower than plain decoding).

A slot costs the worker one more row in the step if the proposer fills it, and brings a
token only if every proposal before it is accepted as well: with a request's acceptance
rate `alpha` (per proposal), its j-th slot brings `alpha**j` tokens on average. A step's
time is about `a + b * rows`. A step of `n` plain rows plus the slots chosen brings `E`
tokens in `t`; a slot raises the step's tokens per second exactly when its expected
tokens exceed `b * E / t`. The best set of slots is found by Dinkelbach's iteration:
start from the plain step's `E / t`, take every slot above `b * E / t`, recompute `E / t`
with them, repeat (a few rounds converge). So one stream (the rows are a small share of
the step) speculates even at low acceptance, and a full batch only where proposals mostly
land. A slot must beat the bar by `MARGIN`: near the break-even a slot brings nothing on
average, and costs beyond the worker's step time are not in the fit.

`a` and `b` are fitted online from the pool's own steps (`execute_seconds` against the rows
the worker ran, recent steps weighing most); until the rows have varied enough to fit a
line, every slot is given. A request whose slots are all refused still gets one every
`PROBE_PERIOD` tokens, so a change in its acceptance is noticed. A request's acceptance is
its own proposals' (accepted / proposed), starting from the pool's.

A draft model costs more than rows: proposing k tokens is k forward passes of the draft,
whatever the batch. The worker reports the seconds its proposals took and its passes;
`DraftCost` keeps the seconds per pass, the rows are fitted on the rest of the step, and
`draft_passes` caps the step's slots at the pass count P (0..k) with the best tokens per
second, `E(P) / (a + b * rows(P) + c * P)`: a draft that seldom lands (a model's own first
layers, untrained for it) drafts nothing, but for the pool's probes (`DraftProbe`). Each
probe costs a draft pass and catching the probed request's draft KV up (its whole context
the first time), so while the draft keeps earning no pass the probes spread out: after
PROBE_PERIOD steps, then each gap twice the last, up to PROBE_PERIOD_MAX steps (a step
that gives the draft passes again starts over at PROBE_PERIOD), and a request waits for
its probe until the steps since the last one are at least the tokens its draft KV must
catch up. Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from common.step_result import StepResult
from services.scheduler.request import Request

PROBE_PERIOD = 64
# A pool's draft probes spread out to one in this many steps while they keep failing.
PROBE_PERIOD_MAX = 2048
# A slot must beat the bar by this factor (see the module docstring).
MARGIN = 1.1
ROUNDS = 4
# Weight of the pool's acceptance in a request's estimate, in proposals.
PRIOR_PROPOSALS = 4.0
# Each step's weight in the fit decays by this much per later step (~50 steps count).
DECAY = 0.98
# The fit needs the rows' spread (their standard deviation) to be at least this: a step of
# a few rows costs about the same whatever their number (the weights are read once), and a
# line through such steps fits noise.
MIN_ROW_SPREAD = 3.0
# The pool's acceptance starts at PRIOR_RATE, weighted as this many proposals.
PRIOR_RATE = 0.5
POOL_PRIOR_PROPOSALS = 32.0
# Weight of a step's seconds per draft pass in DraftCost's running average.
PASS_WEIGHT = 0.2


@dataclass
class StepCost:
    """A step's execute time as `a + b * rows`, fitted with exponential forgetting; the last
    fit is kept while the recent steps all had about the same rows."""

    weight: float = 0.0
    sum_x: float = 0.0
    sum_y: float = 0.0
    sum_xx: float = 0.0
    sum_xy: float = 0.0
    fitted: tuple[float, float] | None = None

    def observe(self, rows: int, seconds: float) -> None:
        if rows <= 0 or seconds <= 0:
            return
        self.weight = self.weight * DECAY + 1.0
        self.sum_x = self.sum_x * DECAY + rows
        self.sum_y = self.sum_y * DECAY + seconds
        self.sum_xx = self.sum_xx * DECAY + rows * rows
        self.sum_xy = self.sum_xy * DECAY + rows * seconds
        mean_x, mean_y = self.sum_x / self.weight, self.sum_y / self.weight
        var_x = self.sum_xx / self.weight - mean_x * mean_x
        if var_x < MIN_ROW_SPREAD**2:
            return  # keep the last fit
        b = (self.sum_xy / self.weight - mean_x * mean_y) / var_x
        b = max(b, 0.0)
        a = max(mean_y - b * mean_x, 1e-6)
        self.fitted = (a, b)

    def line(self) -> tuple[float, float] | None:
        """The fit, or before one a flat line at the mean step time (None: no step yet)."""
        if self.fitted is not None:
            return self.fitted
        return (self.sum_y / self.weight, 0.0) if self.weight > 0 else None

    def bar(self, plain_rows: int, alphas: list[float], max_slots: int) -> float:
        """What a slot's expected tokens must exceed in a step of `plain_rows` rows whose
        decoding requests have these acceptance rates and up to `max_slots` slots each
        (0 before any fit: every slot is given)."""
        if self.fitted is None or plain_rows <= 0 or self.fitted[1] == 0.0:
            return 0.0
        a, b = self.fitted
        bar = b * plain_rows / (a + b * plain_rows)
        for _ in range(ROUNDS):
            tokens, rows = float(plain_rows), float(plain_rows)
            for alpha in alphas:
                paid = _paid(alpha, bar, max_slots)
                tokens += _expected(alpha, paid)
                rows += paid
            bar = b * tokens / (a + b * rows)
        return bar


@dataclass
class DraftCost:
    """Seconds per forward pass of the draft model, an average over recent steps (None until
    a step with a draft pass is seen, and for proposers without a model)."""

    seconds_per_pass: float | None = None

    def observe(self, passes: int, seconds: float) -> None:
        if passes <= 0 or seconds <= 0:
            return
        per_pass = seconds / passes
        old = self.seconds_per_pass
        self.seconds_per_pass = per_pass if old is None else old + PASS_WEIGHT * (per_pass - old)


def draft_passes(
    line: tuple[float, float] | None,
    pass_seconds: float | None,
    plain_rows: int,
    alphas: list[float],
    bar: float,
    max_slots: int,
) -> int:
    """How many slots (draft passes) a step may give any request: the P in 1..max_slots with
    the most expected tokens per second, each request taking min(P, its paid slots), if it
    beats the plain step's rate by MARGIN; else 0. `line` is the step's `a + b * rows`
    without the draft (None: nothing seen yet; every slot is given, as before any fit)."""
    if pass_seconds is None or line is None or plain_rows <= 0 or not alphas:
        return max_slots
    a, b = line
    plain = plain_rows / (a + b * plain_rows)
    paid = [_paid(alpha, bar, max_slots) if bar > 0 else max_slots for alpha in alphas]
    best, best_rate = 0, 0.0
    for passes in range(1, max_slots + 1):
        tokens, rows = float(plain_rows), float(plain_rows)
        for alpha, slots in zip(alphas, paid, strict=True):
            given = min(passes, slots)
            tokens += _expected(alpha, given)
            rows += given
        rate = tokens / (a + b * rows + pass_seconds * passes)
        if rate > best_rate:
            best, best_rate = passes, rate
    return best if best_rate > plain * MARGIN else 0


def _expected(alpha: float, slots: int) -> float:
    """Tokens that `slots` proposals bring at acceptance `alpha`: alpha + ... + alpha**slots."""
    if slots <= 0:
        return 0.0
    return alpha * (1.0 - alpha**slots) / (1.0 - alpha) if alpha < 1 else float(slots)


def _paid(alpha: float, bar: float, max_slots: int) -> int:
    """Slots j = 1.. whose alpha**j beats bar * MARGIN, at most max_slots."""
    floor = bar * MARGIN
    if alpha <= floor or max_slots <= 0:
        return 0
    if alpha >= 1.0 or floor <= 0.0:
        return max_slots
    return min(max_slots, int(math.log(floor) / math.log(alpha) - 1e-12))


def pool_acceptance(num_draft_tokens: int, num_accepted_tokens: int) -> float:
    """The pool's acceptance per proposal, from PRIOR_RATE towards what it measured."""
    prior = POOL_PRIOR_PROPOSALS * PRIOR_RATE
    return (num_accepted_tokens + prior) / (num_draft_tokens + POOL_PRIOR_PROPOSALS)


def acceptance(request: Request, pool_rate: float) -> float:
    """The request's acceptance per proposal: its own, weighted against the pool's."""
    prior = PRIOR_PROPOSALS * pool_rate
    return (request.num_accepted_tokens + prior) / (request.num_draft_tokens + PRIOR_PROPOSALS)


def worth(request: Request, slots: int, bar: float, pool_rate: float, passes: int) -> int:
    """Of `slots` allowed, those whose expected tokens beat `bar`, at most `passes`; a probe
    slot every PROBE_PERIOD tokens when none beats it. With no pass allowed (a draft model
    not worth its passes) the pool probes instead (`DraftProbe`): a request's own probe
    would cost a pass and catching its draft KV up, and a batch's requests would take turns."""
    if slots <= 0 or passes <= 0:
        return 0
    paid = slots if bar <= 0.0 else _paid(acceptance(request, pool_rate), bar, slots)
    if paid == 0 and request.num_tokens % PROBE_PERIOD == 0:
        return 1
    return min(paid, passes)


@dataclass
class DraftProbe:
    """When a pool whose draft model gets no pass probes it (one request, one slot: the
    pool's acceptance keeps being measured): PROBE_PERIOD steps after the draft last got
    passes, then after gaps that double while it still gets none, up to
    PROBE_PERIOD_MAX. A probe costs a pass and catching its request's draft KV up (the
    tokens since the request's last slots: its whole context the first time), so a
    request is probed only once at least that many steps have passed since the last
    probe: catching up costs at most a draft row per step since."""

    gap: int = PROBE_PERIOD
    next_step: int = 0
    last_step: int = 0  # the last probe, or the last step whose draft got passes

    def due(self, step: int, passes: int) -> bool:
        """Whether step number `step` of the pool, whose draft gets `passes`, probes (a
        request `affordable` takes the slot: `probed` then)."""
        if passes > 0:
            self.gap, self.next_step, self.last_step = PROBE_PERIOD, step + PROBE_PERIOD, step
            return False
        return step >= self.next_step

    def affordable(self, step: int, catch_up: int) -> bool:
        """Whether a request whose draft KV is `catch_up` tokens behind may be probed."""
        return catch_up <= step - self.last_step

    def probed(self, step: int) -> None:
        """Step number `step` gave a request the probe's slot."""
        self.next_step, self.last_step = step + self.gap, step
        self.gap = min(2 * self.gap, PROBE_PERIOD_MAX)


@dataclass
class SlotPolicy:
    """A pool's pricing of proposal slots: what a row costs its steps, what its draft's
    pass costs, and when a draft that earns no pass is probed."""

    step_cost: StepCost = field(default_factory=StepCost)
    draft_cost: DraftCost = field(default_factory=DraftCost)
    draft_probe: DraftProbe = field(default_factory=DraftProbe)
    _step: int = 0  # the step `plan` plans

    def observe(self, result: StepResult, num_tokens: int) -> None:
        """A step's result: its rows (`num_tokens` planned, then the proposals) and times."""
        drafts = sum(c.num_draft_tokens for c in result.spec.values())
        self.step_cost.observe(num_tokens + drafts, result.execute_seconds - result.propose_seconds)
        self.draft_cost.observe(result.propose_passes, result.propose_seconds)

    def plan(self, counts, running: list[Request], lookahead, step: int):
        """(bar, pool rate, passes, probe) for step number `step`: what a proposal slot must
        bring, the pool's acceptance rate, the slots a request may get (a draft model's
        passes), and whether the step probes the draft. `counts`: the pool's
        SpecDecodeCounters; `running`: its running requests."""
        pool_rate = pool_acceptance(counts.num_draft_tokens, counts.num_accepted_tokens)
        alphas = [acceptance(r, pool_rate) for r in running]
        k = lookahead.num_speculative_tokens
        rows = len(running)
        bar = self.step_cost.bar(rows, alphas, k)
        line, per_pass = self.step_cost.line(), self.draft_cost.seconds_per_pass
        passes = draft_passes(line, per_pass, rows, alphas, bar, k)
        self._step = step
        return bar, pool_rate, passes, self.draft_probe.due(step, passes)

    def take_probe(self, request: Request) -> bool:
        """Whether the probe due in the step `plan` planned goes to `request` (taken then)."""
        catch_up = request.num_tokens - request.num_draft_synced_tokens
        if not self.draft_probe.affordable(self._step, catch_up):
            return False
        self.draft_probe.probed(self._step)
        return True
