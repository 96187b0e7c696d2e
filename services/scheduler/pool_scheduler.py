"""Continuous batching for one worker pool: what runs in the next step, under a token budget.

One rule covers prefill, chunked prefill and decode: each scheduled request computes
`min(schedulable tokens, budget)` new tokens, where schedulable = tokens known (or, in a
pool that decodes, already being sampled by a step in flight) minus tokens computed.

Each step:
1. Running requests go first, oldest first. Every later decode keeps one token of budget,
   so a long prompt chunk never starves the decodes behind it on a worker that does both.
   When a running request cannot get a block, the newest running request is preempted:
   *recompute* (blocks freed, computed tokens reset; the caller re-queues it) or *swap*
   (its computed KV is copied to the worker's CPU swap space and it waits in `swapped`).
2. If nobody was preempted: swapped requests come back first (swap-in), then waiting ones
   join while the budget, `max_num_seqs` and free blocks allow. A waiting request starts
   from the longest cached prefix of its prompt (never its last token, which must be
   computed to sample from). The samples of an n > 1 request wait until sample 0
   (`Request.prompt_of`) has planned every full prompt block, then start from those blocks.

`num_computed_tokens` advances when a step is planned; full blocks whose tokens are known
are then offered to the prefix cache (kept after it finishes if it asked: `kv_retention`).
A draining decode pool hands its requests on with their KV (`take_migrations`). Pure Python.
"""

from __future__ import annotations

import time
from collections import deque

from common.step_result import StepResult
from services.scheduler.block_manager import BlockManager
from services.scheduler.join_rules import awaits_prompt, lora_fits
from services.scheduler.kv_offload import WAIT, HostOffload
from services.scheduler.kv_peer_connector import PeerLoads
from services.scheduler.kv_retention import retain_finished
from services.scheduler.lookahead import Lookahead, SpecDecodeCounters
from services.scheduler.request import Request
from services.scheduler.spec_goodput import SlotPolicy, worth
from services.scheduler.step_plan import Placed, PoolStepPlan, SampledToken, StepUpdate, scheduled
from services.scheduler.worker_batch import WorkerBatch

PREEMPTION_MODES = ("recompute", "swap")


class PoolScheduler:
    """Waiting, running and swapped queues of one worker, and its block managers."""

    def __init__(
        self,
        blocks: BlockManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        *,
        runs_decodes: bool = True,
        preemption_mode: str = "recompute",
        swap_blocks: BlockManager | None = None,
        lookahead: Lookahead | None = None,
        max_loras: int = 0,
        offload: HostOffload | None = None,
    ) -> None:
        """Settings come checked (SchedulerConfig; swap space by bootstrap.pool_scheduler).
        `lookahead`: the worker verifies proposals (speculative decoding). `max_loras`:
        distinct LoRA adapters the running requests may use at once (0: no limit).
        `offload`: the worker's host-memory offload tier (kv_offload.py)."""
        self.offload = offload
        self.lookahead = lookahead
        self.slot_policy = SlotPolicy()  # what a proposal slot costs here (spec_goodput.py)
        self.max_loras = max_loras
        self.blocks = blocks
        self.swap_blocks = swap_blocks
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.runs_decodes = runs_decodes
        self.preemption_mode = preemption_mode
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.batch = WorkerBatch()
        self.peer_loads = PeerLoads(blocks)  # KV from peers, carried by plans
        # Per step sent and not yet answered, oldest first: its number, the requests it
        # computes, their proposal slots (those with any), and the tokens it computes.
        self._in_flight: deque[tuple[int, dict[str, Request], dict[str, int], int]] = deque()
        self._num_planned = 0
        self.migrating = False  # draining: requests leave with their KV (`take_migrations`)
        # Prefix cache, in tokens (vLLM's): the tokens of requests that looked it up on
        # admission, and the tokens found there.
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0
        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.spec_decode = SpecDecodeCounters()
        self.num_migrations_out = 0
        # Tokens computed at prompt positions, or recomputing output after a preemption or
        # a restart (every position before the last sampled token): a request that arrives
        # with its KV adds none.
        self.num_prompt_tokens_computed = 0

    # -- queue changes -------------------------------------------------------------------
    def add(self, request: Request, front: bool = False) -> None:
        """Queue a request; its blocks here (if any) must already cover num_computed_tokens."""
        self.batch.come_back(request.request_id)  # left, and back before it was dropped
        if front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def detach(self, request: Request) -> None:
        """Take the request out of this pool's queues and the worker's batch; keep its blocks."""
        for queue in (self.running, self.waiting, self.swapped):
            if request in queue:
                queue.remove(request)
                break
        self.batch.drop(request.request_id)
        if self.offload is not None:
            self.offload.release(request.request_id)

    def release(self, request: Request) -> int:
        """Detach the request and free its blocks (and swap space); returns blocks freed."""
        self.detach(request)
        if self.swap_blocks is not None:
            self.swap_blocks.free(request.request_id)
        return self.blocks.free(request.request_id)

    # -- draining with KV ------------------------------------------------------------------
    def take_migrations(self) -> list[Request]:
        """While `migrating` (set by the engine on a draining decode pool while another
        decode pool accepts; `schedule()` then plans only swap-ins, so the steps in flight
        run out): take out every running or waiting request that holds KV here and that no
        step in flight computes for, oldest first. Each keeps its blocks (the hand-off frees
        them once its KV has moved) and goes on elsewhere with nothing recomputed."""
        if not self.migrating:
            return []
        busy = {rid for _, step, _, _ in self._in_flight for rid in step}
        ready = [
            r
            for r in (*self.running, *self.waiting)
            if r.request_id not in busy
            and not r.num_pending_tokens
            and r.num_computed_tokens
            and not r.is_finished
        ]
        for request in ready:
            (self.running if request in self.running else self.waiting).remove(request)
            self.batch.leave(request.request_id)
        self.num_migrations_out += len(ready)
        return ready

    def take_back(self, request: Request) -> None:
        """A move that has not started is called off: the request (still holding its
        blocks here, and still in the worker's batch if it ran here) waits here again."""
        self.batch.stay(request.request_id)
        self.waiting.appendleft(request)

    # -- introspection ---------------------------------------------------------------------
    def schedulable_tokens(self, request: Request) -> int:
        """Tokens the next step could compute for the request."""
        known = request.num_known_tokens
        if self.runs_decodes and not request.will_finish:
            known += request.num_pending_tokens  # the worker computes what it sampled
        return known - request.num_computed_tokens

    @property
    def num_queued_tokens(self) -> int:
        """Tokens still to compute here: the load signal for placement."""
        queues = (*self.running, *self.waiting, *self.swapped)
        return sum(max(0, r.num_tokens - r.num_computed_tokens) for r in queues)

    def holds(self, request: Request) -> bool:
        return request in self.running or request in self.waiting or request in self.swapped

    def is_running(self, request: Request) -> bool:
        return request in self.running

    def check_integrity(self) -> None:
        self.blocks.check_integrity()
        if self.offload is not None:
            self.offload.check_integrity()
        if self.swap_blocks is not None:
            self.swap_blocks.check_integrity()
        ids = [r.request_id for q in (self.running, self.waiting, self.swapped) for r in q]
        if len(ids) != len(set(ids)):
            raise AssertionError("a request sits in two queues at once")

    # -- the step ------------------------------------------------------------------------------
    def schedule(self) -> PoolStepPlan:
        plan = PoolStepPlan()
        # This step tells the worker; blocks it allocates are written only after that.
        self.peer_loads.take(plan, idle=not self._in_flight)
        self.batch.drop_departed(self.blocks.has)
        if self.offload is not None:  # (and a hand-off's loads and saves, on a decode pool)
            self.offload.begin_plan(plan)
            self.offload.handoff.take(plan, self.blocks.pool)
        if self.migrating:  # nothing new runs; swapped requests come back to leave with KV
            self._swap_in(plan, self.max_num_batched_tokens)
        else:
            budget = self._schedule_running(plan)
            if not (plan.preempted or plan.swapped_out):  # memory is short: admit nobody now
                budget = self._swap_in(plan, budget)
                self._admit_waiting(plan, budget)
        plan.dropped_request_ids = self.batch.take_drops()
        if not plan.is_empty:  # the caller sends every plan that is not empty
            self._num_planned += 1
            slots = {s.request.request_id: s.num_lookahead_tokens for s in plan.scheduled}
            self._in_flight.append(
                (
                    self._num_planned,
                    {s.request.request_id: s.request for s in plan.scheduled},
                    {rid: k for rid, k in slots.items() if k},
                    plan.num_scheduled_tokens,
                )
            )
        return plan

    def update(self, result: StepResult) -> StepUpdate:
        """Apply the result of the oldest step in flight: gather prompt logprobs, append
        each sampled token (one pending token becomes known), release requests that finish,
        and take prompts done in a pool that does not decode out of the queues (they keep
        their blocks) for the hand-off, as well as, while migrating, every request no step
        in flight computes for any more. A token for a request that finished or was
        aborted while the step ran is dropped."""
        if not self._in_flight:
            raise ValueError(f"step {result.step_id}: no step of this pool is in flight")
        _, scheduled, slots, num_tokens = self._in_flight.popleft()
        self.peer_loads.finished(result.kv_loads_done)
        if self.offload is not None:  # disk reads done (their requests may start now)
            self.offload.record(result)
        if self.lookahead is not None:
            self.slot_policy.observe(result, num_tokens)
        update = StepUpdate()
        for request_id, k in slots.items():  # this step's proposals are accounted for now
            request = scheduled[request_id]
            request.num_lookahead_in_flight = max(0, request.num_lookahead_in_flight - k)
        for request_id, scored in result.prompt_logprobs.items():
            request = scheduled.get(request_id)
            if request is not None and not request.is_finished and not request.prompt_logprobs_sent:
                del request.prompt_logprobs[scored.start - 1 :]  # a recompute resends positions
                request.prompt_logprobs.extend(scored.entries)
        for request_id, token in result.sampled.items():
            request = scheduled.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.num_pending_tokens <= 0:  # its worker failed and it started over
                update.unexpected.append(request_id)
                continue
            try:
                self._apply_sampled(request, token, result, update)
            except Exception as exc:  # a bug in one request's bookkeeping fails it alone
                self.release(request)
                update.failed.append((request, exc))
        update.ready_for_handoff.extend(self.take_migrations())
        return update

    def _apply_sampled(
        self, request: Request, token: int, result: StepResult, update: StepUpdate
    ) -> None:
        """One request's sampled token (after the proposals it accepted, if any)."""
        request.num_pending_tokens -= 1
        reason = self._apply_accepted(request, result, update)
        if reason is None:
            reason = request.append_token(token)
            prompt_logprobs = []
            if request.sampling.prompt_logprobs is not None and not request.prompt_logprobs_sent:
                prompt_logprobs, request.prompt_logprobs_sent = request.prompt_logprobs, True
            entry = result.logprobs.get(request.request_id)
            update.tokens.append(SampledToken(request, token, entry, prompt_logprobs, reason))
        if reason is not None:
            if request.keep_kv:
                self.detach(request)  # its blocks stay: the engine parks them
            elif self.holds(request):
                retain_finished(self.blocks, self.offload, request)  # its kv_retention_s
                self.release(request)
            update.finished.append(request)
        elif not self.runs_decodes and self.is_running(request):
            self.detach(request)
            update.ready_for_handoff.append(request)

    def _apply_accepted(self, request: Request, result: StepResult, update: StepUpdate):
        """Proposals the request accepted in this step, before its sampled token: each is a
        token of its output, and their KV is computed (unless the request left the running
        queue meanwhile: preempted or swapped, it keeps only what it had). Returns the
        finish reason if one of them ends the request."""
        counts = result.spec.get(request.request_id)
        if counts is not None:
            request.num_draft_tokens += counts.num_draft_tokens
            request.num_accepted_tokens += counts.num_accepted_tokens
            self.spec_decode.record(counts)
        accepted = result.accepted_with_logprobs(request.request_id)
        if accepted and self.is_running(request):
            request.num_computed_tokens += len(accepted)
        for token, entry in accepted:
            reason = request.append_token(token)
            update.tokens.append(SampledToken(request, token, entry, [], reason))
            if reason is not None:
                return reason
        return None

    @property
    def num_steps_in_flight(self) -> int:
        return len(self._in_flight)

    def requests_in_flight(self) -> list[Request]:
        """The requests the steps in flight compute for (once each)."""
        return list({id(r): r for _, s, _, _ in self._in_flight for r in s.values()}.values())

    def _schedule_running(self, plan: PoolStepPlan) -> int:
        budget = self.max_num_batched_tokens
        later_decodes = sum(1 for r in self.running if self.schedulable_tokens(r) == 1)
        policy = self.lookahead is not None and self.lookahead.goodput
        if policy:
            bar, pool_rate, passes, probe = self.slot_policy.plan(
                self.spec_decode, self.running, self.lookahead, self._num_planned
            )
        else:  # every slot the lookahead allows
            bar, pool_rate, probe = 0.0, 0.0, False
            passes = self.lookahead.num_speculative_tokens if self.lookahead else 0
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            index += 1
            todo = self.schedulable_tokens(request)
            if todo <= 0:
                continue  # waiting for a token, or a prompt done in a prefill-only pool
            lookahead = 0
            # Proposals in flight: the worker knows where the request's tokens end, the
            # blocks cover the most they can bring (see lookahead.py).
            ahead = request.num_lookahead_in_flight
            if todo == 1:
                later_decodes -= 1
                num_new = 1
                if ahead and not Lookahead.can_plan_ahead(request):
                    continue  # its steps in flight may finish it: wait for them
                if self.lookahead is not None:
                    lookahead = self.lookahead.slots(
                        request, budget - 1 - later_decodes, len(self.running)
                    )
                    allowed = lookahead
                    lookahead = worth(request, allowed, bar, pool_rate, passes)
                    if probe and allowed and self.slot_policy.take_probe(request):
                        lookahead, probe = 1, False
            else:  # a prompt chunk leaves one token per decode behind it
                num_new = min(todo, budget - later_decodes)
                if num_new <= 0:
                    continue
            start = request.num_computed_tokens
            end = start + ahead + num_new
            if lookahead and not self.blocks.can_allocate(
                request.request_id, end + lookahead, 0, start
            ):
                lookahead = 0  # no room for proposals: a plain step
            while not self.blocks.can_allocate(request.request_id, end, 0, start):
                victim = self.running[-1]
                if self.schedulable_tokens(victim) == 1 and victim is not request:
                    later_decodes -= 1
                self.running.pop()
                self._preempt(victim, plan)
                if victim is request:
                    return budget  # every later request is preempted too
            budget -= num_new + lookahead
            self._commit(plan, request, num_new, start, lookahead=lookahead)
        return budget

    def _swap_in(self, plan: PoolStepPlan, budget: int) -> int:
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.swapped[0]
            if request.num_pending_tokens:
                break  # its last token is still on the way
            computed = request.num_computed_tokens
            num_new = min(self.schedulable_tokens(request), budget)
            if num_new <= 0 or not self.blocks.can_allocate(request.request_id, computed + num_new):
                break
            if not lora_fits(request, self.running, self.max_loras):
                break
            self.swapped.popleft()
            swap_table = self.swap_blocks.table(request.request_id)
            self.blocks.allocate(request.request_id, computed, next_position=computed)
            device_table = self.blocks.table(request.request_id)
            plan.swap_in.extend(
                (s, d) for s, d in zip(swap_table, device_table, strict=True)
                if not self.blocks.is_null(d)
            )  # fmt: skip
            self.swap_blocks.free(request.request_id)
            self.running.append(request)
            budget -= num_new
            self._commit(plan, request, num_new, computed)
        return budget

    def _admit_waiting(self, plan: PoolStepPlan, budget: int) -> None:
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.popleft()
            if request.num_pending_tokens or self._awaits_prompt(request):
                skipped.append(request)  # preempted while a token was on the way, or
                continue  # a sample whose prompt blocks sample 0 is still computing
            if not lora_fits(request, self.running, self.max_loras):
                skipped.append(request)  # its adapter waits for a free LoRA slot
                continue
            if request.grammar_pending:
                skipped.append(request)  # its grammar is compiling (grammar_gate)
                continue
            hits = self._prefix_hits(request)
            loads = self._tier_hits(request, hits, plan)
            if loads is WAIT:  # blocks on their way from disk
                skipped.append(request)
                continue
            start = (
                self.blocks.tokens_in(len(hits) + len(loads))
                if hits or loads
                else request.num_computed_tokens
            )
            num_new = min(request.num_tokens - start, budget)
            if num_new <= 0:
                raise ValueError(f"request {request.request_id} queued with nothing to compute")
            if not self.blocks.can_allocate(
                request.request_id, start + num_new, write_from=start, hits=hits
            ):
                self.waiting.appendleft(request)
                # Nothing runs, so nothing will free blocks: a waiting request that holds
                # blocks (received KV) must give them up, newest first.
                victim = self._newest_waiting_holder() if not self.running else None
                if victim is None:
                    break
                self.waiting.remove(victim)
                self._preempt(victim, plan)
                continue
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = start if hits or loads else 0
                if request.first_scheduled_time is None:
                    request.first_scheduled_time = time.monotonic()
                self.num_prefix_query_tokens += request.num_tokens
                self.num_prefix_hit_tokens += self.blocks.tokens_in(len(hits))  # device
                if self.offload is not None:
                    self.offload.num_query_tokens += request.num_tokens
            self.running.append(request)
            budget -= num_new
            self._commit(plan, request, num_new, start, hits)
            if loads:  # into the fresh blocks after the hits, before the forward pass
                table = self.blocks.table(request.request_id)
                plan.offload_in.extend(zip(loads, table[len(hits) :], strict=False))
                self.offload.loaded(len(loads))
        self.waiting.extendleft(reversed(skipped))

    def _awaits_prompt(self, request: Request) -> bool:
        caching = self.blocks.pool.enable_caching
        queued = (r for q in (self.running, self.waiting, self.swapped) for r in q)
        return caching and awaits_prompt(request, queued, self.blocks.block_size)

    def _tier_hits(self, request: Request, hits: list[int], plan: PoolStepPlan):
        """Offload blocks holding the request's next blocks after its device `hits`;
        WAIT while blocks it needs are read from disk (reads planned now or before)."""
        if self.offload is None or self.blocks.has(request.request_id):
            return []
        tiers = self.offload.hits_for(request, len(hits))
        if tiers is not WAIT:
            plan.disk_saves.extend(tiers[2])
            plan.disk_loads.extend(tiers[1])
        return WAIT if tiers is WAIT or tiers[1] else tiers[0]

    def _prefix_hits(self, request: Request) -> list[int]:
        """Cached blocks for a request that starts from scratch here (none otherwise)."""
        if request.num_computed_tokens or self.blocks.has(request.request_id):
            return []
        if request.sampling.prompt_logprobs is not None:
            return []  # every prompt position's logits must be computed
        request.update_block_hashes(self.blocks.block_size)
        return self.blocks.cached_prefix(
            request.block_hashes, request.all_token_ids, request.num_known_tokens - 1
        )

    def _newest_waiting_holder(self) -> Request | None:
        for request in reversed(self.waiting):
            if request is not self.waiting[0] and self.blocks.has(request.request_id):
                return request
        return None

    def _commit(
        self,
        plan: PoolStepPlan,
        request: Request,
        num_new: int,
        start: int,
        hits: list[int] | None = None,
        lookahead: int = 0,
    ) -> None:
        rid = request.request_id
        is_new = not self.batch.has(rid)
        ahead = request.num_lookahead_in_flight  # slots its steps in flight may fill
        added, copies = self.blocks.allocate(
            rid, start + ahead + num_new + lookahead, start, hits or (), next_position=start
        )
        # Sliding windows: blocks no query reads are freed; the worker gets the new table.
        replaced = self.blocks.trim(rid, start) or copies
        request.num_lookahead_in_flight += lookahead
        if lookahead:
            request.num_draft_synced_tokens = request.num_tokens
        plan.block_copies.extend(copies)
        prompt_end = max(len(request.prompt_token_ids), request.num_known_tokens - 1)
        self.num_prompt_tokens_computed += max(0, min(start + num_new, prompt_end) - start)
        request.num_computed_tokens = start + num_new
        samples = request.num_computed_tokens == request.num_tokens
        if samples:
            request.num_pending_tokens += 1  # this step samples the next token
        self.batch.join(rid)
        request.update_block_hashes(self.blocks.block_size)
        cached = self.blocks.cache_full_blocks(
            rid,
            request.block_hashes,
            request.all_token_ids,
            request.num_computed_tokens,
            request.chain_origin,
        )
        if self.offload is not None and cached:  # saved after this step's forward pass
            pairs, disk_saves = self.offload.saves(cached, request.hash_root, self.blocks.pool, rid)
            plan.offload_out.extend(pairs)
            plan.disk_saves.extend(disk_saves)
        table = self.blocks.table(rid) if is_new or replaced else []  # else not sent
        placed = Placed(table, added, is_new, bool(replaced))
        plan.scheduled.append(scheduled(request, placed, start, num_new, lookahead, samples))

    def _preempt(self, victim: Request, plan: PoolStepPlan) -> None:
        self.num_preemptions += 1
        victim.num_preemptions += 1
        self.batch.drop(victim.request_id)
        if self.offload is not None:
            self.offload.release(victim.request_id)
        computed = victim.num_computed_tokens
        if self._try_swap_out(victim, computed, plan):
            return
        self.blocks.free(victim.request_id)
        victim.num_computed_tokens = 0
        plan.preempted.append(victim)

    def _try_swap_out(self, victim: Request, computed: int, plan: PoolStepPlan) -> bool:
        if self.preemption_mode != "swap" or computed == 0:
            return False
        swap = self.swap_blocks
        if not swap.can_allocate(victim.request_id, computed):
            return False  # swap space is full: recompute instead
        device_table = self.blocks.table(victim.request_id)[: swap.blocks_for_tokens(computed)]
        swap.allocate(victim.request_id, computed)
        plan.swap_out.extend(
            (d, s) for d, s in zip(device_table, swap.table(victim.request_id), strict=True)
            if not self.blocks.is_null(d)
        )  # fmt: skip
        self.blocks.free(victim.request_id)
        self.swapped.append(victim)
        plan.swapped_out.append(victim)
        self.num_swap_outs += 1
        return True
