"""Continuous batching for one worker pool: what runs in the next step, under a token budget.

Each step, running requests go first (oldest first: decodes and unfinished prompt chunks),
then waiting requests join while the budget (`max_num_batched_tokens`), the sequence cap
(`max_num_seqs`) and free blocks allow. A long prompt is split across steps (chunked
prefill) by the same rule that runs decodes: schedule `min(uncomputed tokens, budget)`.
When a running request needs a block and none is free, the newest running request is
preempted (recompute: its blocks are freed and the caller re-queues it).

`num_computed_tokens` advances when a step is planned, so a request whose computed tokens
equal its known tokens waits for the sampled token of that step. Pure Python.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.scheduler.block_manager import BlockManager
from services.scheduler.request import Request


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    # True when the worker has no state for the request yet: send its full data.
    is_new: bool
    # Blocks appended to the table this step (the whole table when is_new).
    new_block_ids: list[int]
    # Tokens already computed before this step (where the new tokens start).
    num_computed_before: int


@dataclass
class PoolStepPlan:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # Requests the worker must drop from its persistent batch before running.
    dropped_request_ids: list[str] = field(default_factory=list)
    # Requests preempted this step: blocks freed, num_computed_tokens reset to 0.
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.dropped_request_ids


class PoolScheduler:
    """Waiting and running queues of one worker, and its block manager."""

    def __init__(
        self, blocks: BlockManager, max_num_batched_tokens: int, max_num_seqs: int
    ) -> None:
        if max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {max_num_batched_tokens}"
            )
        if max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
        self.blocks = blocks
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._on_worker: set[str] = set()
        self._pending_drops: list[str] = []

    # -- queue changes -------------------------------------------------------------------
    def add(self, request: Request, front: bool = False) -> None:
        """Queue a request; its blocks here (if any) must already cover num_computed_tokens."""
        if front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def detach(self, request: Request) -> None:
        """Take the request out of this pool's queues and the worker's batch; keep its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if request.request_id in self._on_worker:
            self._on_worker.discard(request.request_id)
            self._pending_drops.append(request.request_id)

    def release(self, request: Request) -> int:
        """Detach the request and free its blocks; returns how many blocks it held."""
        self.detach(request)
        return self.blocks.free(request.request_id)

    # -- introspection ---------------------------------------------------------------------
    @property
    def has_work(self) -> bool:
        return (
            bool(self._pending_drops)
            or any(r.num_uncomputed_tokens > 0 for r in self.running)
            or bool(self.waiting)
        )

    @property
    def num_queued_tokens(self) -> int:
        """Tokens still to compute here: the placement load signal."""
        return sum(r.num_uncomputed_tokens for r in (*self.running, *self.waiting))

    def holds(self, request: Request) -> bool:
        return request in self.running or request in self.waiting

    # -- the step ------------------------------------------------------------------------------
    def schedule(self) -> PoolStepPlan:
        plan = PoolStepPlan()
        budget = self.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_uncomputed_tokens, budget)
            if num_new <= 0:  # waiting for the token sampled in the step before
                index += 1
                continue
            target = request.num_computed_tokens + num_new
            while not self.blocks.can_allocate(request.request_id, target):
                victim = self.running.pop()
                self._preempt(victim, plan)
                if victim is request:
                    break
            else:
                budget -= num_new
                plan.scheduled.append(self._commit(request, num_new))
                index += 1
                continue
            break  # the request itself was preempted; every later one already was
        if plan.preempted:  # memory is short: do not admit anyone this step
            return self._finish(plan)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            num_new = min(request.num_uncomputed_tokens, budget)
            if num_new <= 0:
                raise ValueError(f"request {request.request_id} queued with nothing to compute")
            if not self.blocks.can_allocate(
                request.request_id, request.num_computed_tokens + num_new
            ):
                # Nothing runs, so nothing will free blocks: a waiting request that holds
                # blocks (received KV) must give them up, newest first.
                victim = self._newest_waiting_holder() if not self.running else None
                if victim is None:
                    break
                self.waiting.remove(victim)
                self._preempt(victim, plan)
                continue
            self.waiting.popleft()
            self.running.append(request)
            budget -= num_new
            plan.scheduled.append(self._commit(request, num_new))
        return self._finish(plan)

    def _newest_waiting_holder(self) -> Request | None:
        for request in reversed(self.waiting):
            if request is not self.waiting[0] and self.blocks.has(request.request_id):
                return request
        return None

    def _commit(self, request: Request, num_new: int) -> ScheduledRequest:
        is_new = request.request_id not in self._on_worker
        computed_before = request.num_computed_tokens
        added = self.blocks.allocate(request.request_id, computed_before + num_new)
        request.num_computed_tokens = computed_before + num_new
        self._on_worker.add(request.request_id)
        return ScheduledRequest(
            request=request,
            num_new_tokens=num_new,
            is_new=is_new,
            new_block_ids=self.blocks.table(request.request_id) if is_new else added,
            num_computed_before=computed_before,
        )

    def _preempt(self, victim: Request, plan: PoolStepPlan) -> None:
        self.blocks.free(victim.request_id)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        if victim.request_id in self._on_worker:
            self._on_worker.discard(victim.request_id)
            self._pending_drops.append(victim.request_id)
        plan.preempted.append(victim)

    def _finish(self, plan: PoolStepPlan) -> PoolStepPlan:
        plan.dropped_request_ids = self._pending_drops
        self._pending_drops = []
        return plan
