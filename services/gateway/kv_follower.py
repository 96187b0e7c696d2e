"""Follows one scheduler's `KvEvents` stream into the router (the grpc side of
`kv_index.py`), so that routing across several schedulers follows what each really holds.

Each subscription builds a fresh index from the scheduler's snapshot and hands it to the
router only once the snapshot is complete; deltas then keep it current. When the stream
breaks its rules (a gap: this gateway fell behind and lost batches; a malformed message)
or ends (the scheduler restarted or went away, or has no events: an older scheduler,
`--enable-kv-cache-events false`), the router goes back to its memory of what it sent to
that scheduler, and the follower subscribes again: after `retry_s`, doubled for each
failure in a row up to `MAX_RETRY_S`, back to `retry_s` once a snapshot completes. Routing
never waits on a stream.
"""

from __future__ import annotations

import asyncio

import grpc

from common.kv_events_pb import batch_from_pb
from common.log import get_logger
from common.pb.tandem.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.gateway.kv_index import EventStream, SchedulerKvIndex, StreamGap
from services.gateway.metrics import kv_events_lost, watch_kv_events
from services.gateway.scheduler_router import SchedulerRouter, gateway_root

log = get_logger(__name__)
MAX_RETRY_S = 30.0


class KvEventsFollower:
    def __init__(
        self,
        address: str,
        stub: scheduler_pb2_grpc.SchedulerServiceStub,
        router: SchedulerRouter,
        retry_s: float,
    ) -> None:
        self.address = address
        self._stub = stub
        self._router = router
        self._retry_s = retry_s
        self.num_subscriptions = 0
        watch_kv_events(address, lambda: router.indexes.get(address))

    async def run(self) -> None:
        """Follow until cancelled."""
        delay = self._retry_s
        while True:
            synced, reason = await self._follow_once()
            self._router.unfollow(self.address)
            kv_events_lost(self.address, reason)
            delay = self._retry_s if synced else min(MAX_RETRY_S, delay * 2)
            log.warning("kv_events_lost", scheduler=self.address, reason=reason, retry_s=delay)
            await asyncio.sleep(delay)

    async def _follow_once(self) -> tuple[bool, str]:
        """One subscription: (whether its snapshot completed, why it ended)."""
        self.num_subscriptions += 1
        stream = EventStream(SchedulerKvIndex(gateway_root))
        call = self._stub.KvEvents(scheduler_pb2.KvEventsRequest())
        try:
            async for response in call:
                if stream.feed(batch_from_pb(response.batch)):
                    self._router.follow(self.address, stream.index)
                    log.info(
                        "kv_events_following",
                        scheduler=self.address,
                        blocks=stream.index.num_blocks,
                        seq=stream.next_seq - 1,
                    )
            return stream.synced, "ended"
        except StreamGap as exc:
            log.warning("kv_events_gap", scheduler=self.address, error=str(exc))
            return stream.synced, "gap"
        except ValueError as exc:  # a message that breaks the events' shapes
            log.warning("kv_events_bad_message", scheduler=self.address, error=str(exc))
            return stream.synced, "bad_message"
        except grpc.aio.AioRpcError as exc:
            return stream.synced, exc.code().name.lower()
        finally:
            call.cancel()
