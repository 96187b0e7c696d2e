"""The scheduler side of the peers' KV connector: how a hand-off's blocks move from one
worker's pool to another's, once `handoff.KvHandoff` has decided which blocks go where and
when they are final. Each move is a load in the receiving pool's next plan (`peer_loads`),
whose outcome comes back with that worker's step results. The worker side is
`services/worker/kv_peer_connector.py`.

- Same host (both workers describe one `KvSharedMemory.host_id`, and the receiver has
  not refused to map the sender's pool): a load with a source; the decode worker copies
  the blocks straight out of the prefill worker's shared pool, layer by layer as they are
  written.
- Otherwise: a load without one on the receiver and `SendKv` on the sender with the same
  UCX tag, together (each side's parallel layout travels with its half); the first failure
  ends the move.
A receiver that cannot map a sender's pool (`KvLoadDone.pull_refused`) makes that pair use
UCX from then on.
"""

from __future__ import annotations

import asyncio

from common.log import get_logger
from common.parallel_plan import Layout
from common.step_plan import KvLoad, KvSource
from common.tracing import current_carrier
from services.scheduler.handle import TransferPart
from services.scheduler.pool import Pool
from services.scheduler.worker_types import (
    KvPullRefusedError,
    KvTransferResult,
    WorkerInfo,
    WorkerUnavailableError,
)

log = get_logger(__name__)


def pull_source(src: WorkerInfo, block_ids, ready_step_id: int) -> KvSource:
    """`src`'s blocks, final once it has run step `ready_step_id`, for a same-host pull."""
    return KvSource(
        worker_id=src.worker_id,
        shared_memory=src.shared_memory,
        block_ids=tuple(block_ids),
        ready_step_id=ready_step_id,
        tensor_parallel_size=src.tensor_parallel_size,
        rank_shared_memory=tuple(src.rank_shared_memory),
        pipeline_parallel_size=src.pipeline_parallel_size,
    )


class PeerKvConnector:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        # (source, receiver) worker ids whose receiver could not map the source's pool.
        self._no_pull: set[tuple[str, str]] = set()

    def can_pull(self, src: Pool, dst: Pool) -> bool:
        """`dst`'s worker copies KV straight out of `src`'s (so it can stream it)."""
        pair = (src.info.worker_id, dst.info.worker_id)
        return dst.info.can_pull_from(src.info) and pair not in self._no_pull

    def failed(self, src: Pool, dst: Pool, error: BaseException) -> None:
        """A move between the two failed with `error`."""
        if isinstance(error, KvPullRefusedError):  # from now on these two use UCX
            self._no_pull.add((src.info.worker_id, dst.info.worker_id))
            log.warning("kv_pull_refused", src=src.info.worker_id, dst=dst.info.worker_id)

    async def move(self, src: Pool, dst: Pool, tag: int, part: TransferPart) -> KvTransferResult:
        """One part of a transfer, as a load in `dst`'s next plan (written there only after
        the steps planned before it; `KvHandoff` gives it up with `PeerLoads.cancel`)."""
        pull = self.can_pull(src, dst)
        traceparent, tracestate = current_carrier()  # the transfer's span, when traced
        load = KvLoad(
            tag,
            tuple(part.dst_blocks),
            pull_source(src.info, part.src_blocks, part.ready_step_id) if pull else None,
            Layout(src.info.tensor_parallel_size, src.info.pipeline_parallel_size),
            traceparent,
            tracestate,
        )
        calls = [asyncio.ensure_future(self._load(dst, load))]
        if not pull:
            calls.append(
                asyncio.ensure_future(
                    src.client.send_kv(tag, dst.info, list(part.src_blocks), self.timeout_s)
                )
            )
        try:
            done, _ = await asyncio.wait(calls, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for call in calls:
                call.cancel()
        error = next((c.exception() for c in done if c.exception() is not None), None)
        if error is not None:
            raise error
        return calls[0].result()

    async def _load(self, dst: Pool, load: KvLoad) -> KvTransferResult:
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
        return KvTransferResult(outcome.num_bytes, outcome.source_lag_seconds)
