"""The scheduler side of the peers' KV connector (worker side:
`services/worker/kv_peer_connector.py`).

- `PeerKvConnector`: how one part of a hand-off's blocks moves, once `handoff.KvHandoff`
  has decided which blocks go where and when they are final. Each move is a load in the
  receiving pool's next plan; on one host the receiver pulls the blocks out of the sender's
  shared pool, else a `SendKv` on the sender runs beside the load with the same UCX tag. A
  pair whose receiver could not map the sender's pool (`KvLoadDone.pull_refused`) uses UCX
  from then on.
- `PeerLoads`: a pool's loads, as its plans carry them (vLLM V1's connector metadata in
  the scheduler output, and its finished receives in the model runner's output). While a
  load runs and no step is in flight, the next plan is an `await_kv` plan: the worker
  answers it once a load ends or another plan arrives, so an idle pool hears of its loads
  without polling.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from common.log import get_logger
from common.parallel_plan import Layout
from common.step_plan import KvLoad, KvSource
from common.step_result import KvLoadDone
from common.tracing import current_carrier
from services.scheduler.worker_types import KvPullRefusedError, WorkerUnavailableError

if TYPE_CHECKING:  # (the pool's scheduler holds its `PeerLoads`)
    from services.scheduler.block_manager import BlockManager
    from services.scheduler.handle import TransferPart
    from services.scheduler.pool import Pool

log = get_logger(__name__)


class PeerKvConnector:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        # (source, receiver) worker ids whose receiver could not map the source's pool.
        self._no_pull: set[tuple[str, str]] = set()

    def can_pull(self, src: Pool, dst: Pool) -> bool:
        """`dst`'s worker copies KV straight out of `src`'s pool (same host: it can stream it)."""
        pool = src.info.shared_memory
        reachable = pool is not None and pool.reachable_from(dst.info.shared_memory)
        return reachable and (src.info.worker_id, dst.info.worker_id) not in self._no_pull

    def failed(self, src: Pool, dst: Pool, error: BaseException) -> None:
        """A move between the two failed with `error`."""
        if isinstance(error, KvPullRefusedError):  # from now on these two use UCX
            self._no_pull.add((src.info.worker_id, dst.info.worker_id))
            log.warning("kv_pull_refused", src=src.info.worker_id, dst=dst.info.worker_id)

    async def move(self, src: Pool, dst: Pool, tag: int, part: TransferPart) -> KvLoadDone:
        """One part of a transfer, as a load in `dst`'s next plan (written there only after
        the steps planned before it; `KvHandoff` gives it up with `PeerLoads.cancel`)."""
        info, source = src.info, None
        layout = Layout(info.tensor_parallel_size, info.pipeline_parallel_size)
        if self.can_pull(src, dst):
            pools = (info.shared_memory, *info.rank_shared_memory)
            source = KvSource(
                info.worker_id, pools, tuple(part.src_blocks), part.ready_step_id, layout
            )
        # The transfer's span, when traced.
        load = KvLoad(tag, tuple(part.dst_blocks), source, layout, *current_carrier())
        if source is not None:
            return await self._load(dst, load)
        send = src.client.send_kv(tag, dst.info, list(part.src_blocks), self.timeout_s)
        calls = [asyncio.ensure_future(self._load(dst, load)), asyncio.ensure_future(send)]
        try:  # the first failure raises here; the other call is cancelled
            return (await asyncio.gather(*calls))[0]
        finally:
            for call in calls:
                call.cancel()

    async def _load(self, dst: Pool, load: KvLoad) -> KvLoadDone:
        outcome_of = dst.scheduler.peer_loads.start(load)
        dst.wakeup.set()  # an idle pool plans the step that carries it
        try:
            outcome = await asyncio.wait_for(outcome_of, self.timeout_s)
        except TimeoutError:
            raise WorkerUnavailableError(
                f"KV load {load.tag:#x} on {dst.info.address}: no outcome in {self.timeout_s}s"
            ) from None
        if outcome.pull_refused:
            raise KvPullRefusedError(f"KV load on {dst.info.address}: {outcome.error}")
        if outcome.error:
            raise WorkerUnavailableError(
                f"KV load {load.tag:#x} on {dst.info.address} failed: {outcome.error}"
            )
        return outcome


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
