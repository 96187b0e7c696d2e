"""Routing across two schedulers by their KV events, over real gRPC: two in-process
schedulers (each an Engine over a fake worker, served by the real SchedulerServicer with
its KvEventHub on a real gRPC server) behind the gateway's real `Schedulers` (its
sessions and its `KvEvents` followers over real channels).

- A prompt sharing a prefix goes where the prefix is really cached, in the case the
  gateway's memory of what it sent gets wrong: the scheduler it sent the prefix to reset
  its cache, and traffic the gateway never sent cached it on the other one; that one then
  serves it from its cache.
- A gateway that falls behind loses batches (forced: several polls with no await between,
  a one-batch queue): it sees the gap, falls back and subscribes again, and the new
  snapshot is what the scheduler holds.
- A scheduler whose server goes away: routing falls back to the memory of what was sent,
  picks go on, nothing raises or hangs.

Conditions are awaited, never slept for.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from common.grpc_server import SERVER_OPTIONS
from common.keepalive import Keepalive
from common.pb.tandem.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.gateway.metrics import ROUTER_KV_LOST
from services.gateway.scheduler_router import RouterConfig, prompt_block_hashes
from services.gateway.schedulers import Schedulers
from services.scheduler.kv_event_hub import KvEventHub, KvEventsConfig
from services.scheduler.server import SchedulerServicer
from tests.engine_cluster import cluster, collect, prompt, submit, until
from tests.fake_worker import worker_info

pytestmark = pytest.mark.timeout(60)
BS = 4
PREFIX = prompt(7, 6 * BS)  # six full blocks


@contextlib.asynccontextmanager
async def scheduler(name: str, hub_config: KvEventsConfig | None = None):
    """One scheduler (an Engine over a fake `both` worker) on a real gRPC server."""
    async with cluster(worker_info(f"{name}0", "both", num_blocks=48, block_size=BS)) as c:
        servicer = SchedulerServicer()
        servicer.engine, servicer.model = c.engine, c.engine.pools[0].info.model
        hub = servicer.kv_events = KvEventHub(
            lambda: c.engine.pools, config=hub_config or KvEventsConfig(interval_s=0.002)
        )
        publishing = asyncio.ensure_future(hub.run())
        server = grpc.aio.server(options=SERVER_OPTIONS + Keepalive.from_env().server_options())
        scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        c.address, c.hub, c.server = f"127.0.0.1:{port}", hub, server
        try:
            yield c
        finally:
            publishing.cancel()
            await server.stop(0)


@contextlib.asynccontextmanager
async def gateway(*addresses: str):
    schedulers = Schedulers(addresses, None, RouterConfig(kv_events_retry_s=0.01))
    await schedulers.wait_models(10)
    schedulers.start()
    try:
        yield schedulers
    finally:
        await schedulers.close()


def request(rid: str, ids: list[int], max_tokens: int = 3) -> scheduler_pb2.SubmitRequest:
    return scheduler_pb2.SubmitRequest(request_id=rid, prompt_token_ids=ids, max_tokens=max_tokens)


async def through_gateway(schedulers: Schedulers, message) -> tuple[str, int]:
    """Route and run a request as the gateway does: (where it ran, its cached tokens)."""
    backend = schedulers.pick(message)
    assert backend is not None
    cached = None
    try:
        async for update in await backend.session.submit(message):
            cached = update.cached_tokens if cached is None else cached
    finally:
        schedulers.finished(message.request_id)
    return backend.address, cached


def overlap(schedulers: Schedulers, address: str, ids: list[int]) -> int:
    index = schedulers.router.indexes.get(address)
    return -1 if index is None else index.overlap(prompt_block_hashes(ids, BS))


def test_a_shared_prefix_goes_where_the_events_say_it_is_cached():
    async def main():
        async with scheduler("a") as a, scheduler("b") as b, gateway(a.address, b.address) as gw:
            by_address = {a.address: a, b.address: b}
            await until(lambda: len(gw.router.indexes) == 2, what="following both")
            home, cached = await through_gateway(gw, request("first", PREFIX + [1]))
            assert cached == 0
            other = next(x for x in by_address if x != home)
            await until(lambda: overlap(gw, home, PREFIX) == 6, what="home's blocks")
            # The home scheduler forgets its cache; traffic the gateway never sent caches
            # the prefix on the other one.
            async with grpc.aio.insecure_channel(home) as channel:
                reset = await scheduler_pb2_grpc.SchedulerServiceStub(channel).ResetPrefixCache(
                    scheduler_pb2.ResetPrefixCacheRequest(), timeout=10
                )
            assert reset.num_blocks_dropped >= 6
            direct = submit(by_address[other], "direct", PREFIX + [2], 3)
            await collect(direct.events)
            await until(lambda: overlap(gw, home, PREFIX) == 0, what="home's reset")
            await until(lambda: overlap(gw, other, PREFIX) == 6, what="the other's blocks")
            # What the gateway remembers having sent says `home`; the events say `other`.
            hashes = prompt_block_hashes(PREFIX + [3], BS)
            assert gw.router.tracker.overlap(home, hashes) == 6
            assert gw.router.tracker.overlap(other, hashes) == 0
            for i in range(3):
                ran_on, cached = await through_gateway(gw, request(f"r{i}", PREFIX + [3 + i]))
                assert ran_on == other
                assert cached >= len(PREFIX)  # really served from its cache
            assert len(gw.router.in_flight) == 0

    asyncio.run(main())


def test_a_gateway_that_falls_behind_sees_the_gap_and_resubscribes():
    async def main():
        # Polled only by hand: a one-batch queue, so two polls in a row lose a batch.
        config = KvEventsConfig(interval_s=3600, max_pending_batches=1)
        async with scheduler("a", config) as a, scheduler("b") as b:
            async with gateway(a.address, b.address) as gw:
                follower = next(f for f in gw.followers if f.address == a.address)
                await until(lambda: a.address in gw.router.indexes, what="following a")
                gaps = ROUTER_KV_LOST.labels(a.address, "gap")._value.get()

                def publish() -> None:  # a batch (an empty pool's reset still says so)
                    a.pool("a0").blocks.pool.reset_cache()
                    a.hub.poll()

                for _ in range(3):  # no await in between: the gateway cannot keep up
                    publish()
                assert a.hub.num_dropped >= 1

                def resubscribed() -> bool:
                    publish()  # the batch after the lost ones shows the gap
                    return follower.num_subscriptions == 2 and a.address in gw.router.indexes

                await until(resubscribed, what="resubscribed")
                assert ROUTER_KV_LOST.labels(a.address, "gap")._value.get() == gaps + 1
                # Synced again, from a snapshot: it follows what a caches.
                await collect(submit(a, "x", PREFIX, 2).events)

                def holds_prefix() -> bool:
                    a.hub.poll()
                    return overlap(gw, a.address, PREFIX) == 6

                await until(holds_prefix, what="a's blocks")

    asyncio.run(main())


def test_a_scheduler_whose_stream_breaks_falls_back_and_routing_goes_on():
    async def main():
        async with scheduler("a") as a, scheduler("b") as b, gateway(a.address, b.address) as gw:
            await until(lambda: len(gw.router.indexes) == 2, what="following both")
            await b.server.stop(0)  # its stream (and session) break
            await until(lambda: b.address not in gw.router.indexes, what="b unfollowed")
            assert a.address in gw.router.indexes
            # Picks go on (b is still a candidate until its health says otherwise: the
            # router now knows it only from what it sent there).
            hashes = prompt_block_hashes(PREFIX, BS)
            for i in range(4):
                assert gw.pick(request(f"p{i}", PREFIX)) is not None
                gw.finished(f"p{i}")
            assert gw.router.overlap(b.address, hashes) == gw.router.tracker.overlap(
                b.address, hashes
            )

    asyncio.run(main())
