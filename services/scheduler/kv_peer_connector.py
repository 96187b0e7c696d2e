"""The scheduler side of the peers' KV connector on a receiving pool (worker side:
`services/worker/kv_peer_connector.py`): the pool's loads, as its plans carry them (vLLM
V1's connector metadata in the scheduler output, and its finished receives in the model
runner's output). While a load runs and no step is in flight, the next plan is an
`await_kv` plan: the worker answers it once a load ends or another plan arrives, so an idle
pool hears of its loads without polling. Which loads to start, and the `SendKv` beside a
UCX one, is the hand-off's (`handoff.PeerKvConnector`).

Asyncio futures only; no grpc, no torch.
"""

from __future__ import annotations

import asyncio

from common.step_plan import KvLoad
from common.step_result import KvLoadDone
from services.scheduler.block_manager import BlockManager


class PeerLoads:
    def __init__(self, blocks: BlockManager) -> None:
        self.blocks = blocks
        self._queued: list[KvLoad] = []
        self._running: dict[int, asyncio.Future[KvLoadDone]] = {}  # tag -> its outcome
        self._tags: list[int] = []  # cancelled, not yet sent
        self._held: list[str] = []

    def start(self, load: KvLoad) -> asyncio.Future[KvLoadDone]:
        """Queue `load` for the next plan (the caller wakes the pool); the future resolves
        with its outcome, from the first step result the worker sends after it ended."""
        future = asyncio.get_running_loop().create_future()
        self._queued.append(load)
        self._running[load.tag] = future
        return future

    def cancel(self, tag: int, request_id: str) -> None:
        """Give up load `tag` into `request_id`'s blocks (a cancelled request, a failed
        transfer). The worker learns the tag with the next plan; until that plan is made
        the blocks stay allocated under a key of their own, so a load still under way there
        cannot write into blocks already given to another request. A load never sent
        (still queued) is dropped, its blocks free at once."""
        future = self._running.pop(tag, None)
        if future is not None:
            future.cancel()
        sent = future is not None and all(load.tag != tag for load in self._queued)
        self._queued = [load for load in self._queued if load.tag != tag]
        self._tags.append(tag)  # (the worker ignores a tag it never saw)
        if not self.blocks.has(request_id):
            return
        if sent:  # it may run on the worker
            key = f"\0cancelled-transfer-{tag:x}"
            self.blocks.fork(request_id, key)
            self._held.append(key)
        self.blocks.free(request_id)

    @property
    def pending(self) -> bool:
        """Loads or cancels the next plan must carry."""
        return bool(self._queued or self._tags)

    def take(self, plan, idle: bool) -> None:
        """Put what the next plan carries into `plan` (a `PoolStepPlan`): the cancelled tags
        (the blocks held for them are free now) and the queued loads; with no step in flight
        (`idle`) and loads under way, it awaits them."""
        plan.await_kv = idle and bool(self._running)
        if not (self._held or self._tags or self._queued):  # (most plans)
            return
        for key in self._held:
            self.blocks.free(key)
        plan.cancelled_transfer_tags, self._held, self._tags = self._tags, [], []
        plan.kv_loads, self._queued = self._queued, []

    def finished(self, outcomes: tuple[KvLoadDone, ...]) -> None:
        """A step result's ended loads (a cancelled one's outcome is dropped)."""
        for outcome in outcomes:
            future = self._running.pop(outcome.tag, None)
            if future is not None and not future.done():
                future.set_result(outcome)

    def fail_all(self, error: BaseException) -> None:
        """The worker is gone: every load fails with `error`, and what was held is free (a
        new step stream, which drops every load, comes before any reuse)."""
        running, self._running, self._queued, self._tags = self._running, {}, [], []
        for future in running.values():
            if not future.done():
                future.set_exception(error)
        for key in self._held:
            self.blocks.free(key)
        self._held = []
