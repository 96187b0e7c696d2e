"""The scheduler side of the peers' KV connector: how a hand-off's blocks move from one
worker's pool to another's, once `handoff.KvHandoff` has decided which blocks go where and
when they are final. The worker side is `services/worker/kv_peer_connector.py`.

- Same host (both workers describe one `KvSharedMemory.host_id`, and the receiver has
  not refused to map the sender's pool): one `ReceiveKv` with a source; the decode worker
  copies the blocks straight out of the prefill worker's shared pool, layer by layer as
  they are written.
- Otherwise: `ReceiveKv` on the receiver and `SendKv` on the sender with the same UCX tag,
  issued together (each side's parallel layout travels with the call); the first failure
  stops the other call.
A receiver that cannot map a sender's pool (`KvPullRefusedError`) makes that pair use UCX
from then on.
"""

from __future__ import annotations

import asyncio

from common.log import get_logger
from services.scheduler.handle import TransferPart
from services.scheduler.pool import Pool
from services.scheduler.worker_types import KvPullRefusedError, KvPullSource, KvTransferResult

log = get_logger(__name__)


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

    async def move(
        self, src: Pool, dst: Pool, tag: int, part: TransferPart, after_step: int
    ) -> KvTransferResult:
        """One part of a transfer; written into `dst` only after its step `after_step`."""
        if self.can_pull(src, dst):
            source = KvPullSource(src.info, part.src_blocks, part.ready_step_id)
            receive = dst.client.receive_kv(
                tag, part.dst_blocks, self.timeout_s, after_step, source
            )
            calls = [asyncio.ensure_future(receive)]
        else:
            calls = [
                asyncio.ensure_future(
                    dst.client.receive_kv(
                        tag, part.dst_blocks, self.timeout_s, after_step, sender=src.info
                    )
                ),
                asyncio.ensure_future(
                    src.client.send_kv(tag, dst.info, part.src_blocks, self.timeout_s)
                ),
            ]
        try:
            done, _ = await asyncio.wait(calls, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for call in calls:
                call.cancel()
        error = next((c.exception() for c in done if c.exception() is not None), None)
        if error is not None:
            raise error
        return calls[0].result()
