"""The scheduler's Engine, KvHandoff and PoolMonitor in-process, against fake workers
(`tests/fake_worker.py`, harness in `tests/engine_cluster.py`): exact token streams, finish
reasons, hand-offs and aborts in every stage; after each scenario nothing leaks (every block
free, every worker's batch empty, the engine's integrity check clean). Worker failures,
transfers, draining, preemption and admission: `test_engine_failures_inprocess.py`.

Only the Engine's public surface is used: the constructor, start, submit, abort, fork,
release_kv, the events of each request (Tokens / Finished), check_integrity, close, the
pools' counters, health flags, block managers and scheduler queues, the engine's counters,
and a handle's stage. Engine internals (`_apply`, the hand-off's pumping) are not touched.
"""

from __future__ import annotations

import asyncio

import pytest

from services.scheduler.handle import Stage, Tokens
from services.scheduler.request import FinishReason, Request
from tests.engine_cluster import (
    Stream,
    assert_aborted,
    assert_clean,
    assert_exact,
    cluster,
    collect,
    prompt,
    run,
    stop_case,
    submit,
    until,
)
from tests.fake_worker import worker_info

pytestmark = pytest.mark.timeout(30)


# -- one worker that does both ---------------------------------------------------------------
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_both_worker_streams_exact_tokens_and_frees_everything(async_scheduling):
    async def scenario():
        async with cluster(
            worker_info("w0"), max_num_batched_tokens=16, async_scheduling=async_scheduling
        ) as c:
            cases = [(prompt(i, length), 3 + 2 * i) for i, length in enumerate([1, 4, 7, 13, 30])]
            stop_prompt = prompt(9, 6)
            stop = stop_case(stop_prompt, 4)
            handles = [submit(c, f"r{i}", p, n) for i, (p, n) in enumerate(cases)]
            stop_handle = submit(c, "stop", stop_prompt, 50, stop=[stop])
            streams = await asyncio.gather(*(collect(h.events) for h in handles))
            for stream, (p, n) in zip(streams, cases, strict=True):
                assert_exact(stream, p, n)
            stopped = await collect(stop_handle.events)
            assert_exact(stopped, stop_prompt, 50, [stop])
            assert stopped.finished.reason is FinishReason.STOP and len(stopped.tokens) < 50
            assert c.pool("w0").counters.steps > 0
            await assert_clean(c)

    run(scenario())


def test_parallel_samples_share_the_prompt_blocks():
    async def scenario():
        async with cluster(worker_info("w0")) as c:
            p = prompt(3, 13)
            leader = Request("n-0", p, 8)
            samples = [leader, Request("n-1", p, 8, index=1, prompt_of=leader.request_id)]
            (handle, _) = c.engine.submit(samples)
            streams = await collect(handle.events, samples=2)
            for stream in streams.values():
                assert_exact(stream, p, 8)
            assert streams[0].finished.cached_tokens == 0
            assert streams[1].finished.cached_tokens == 12  # three full blocks of four
            assert streams[1].first_cached_tokens == 12
            await assert_clean(c)

    run(scenario())


# -- disaggregated -------------------------------------------------------------------------
def test_prefill_to_decode_handoff_moves_kv_and_streams_exact_tokens():
    async def scenario():
        async with cluster(worker_info("p0", "prefill"), worker_info("d0", "decode")) as c:
            cases = [(prompt(i, length), 4 + i) for i, length in enumerate([1, 3, 8, 13, 21])]
            handles = [submit(c, f"r{i}", p, n) for i, (p, n) in enumerate(cases)]
            streams = await asyncio.gather(*(collect(h.events) for h in handles))
            for stream, (p, n) in zip(streams, cases, strict=True):
                assert_exact(stream, p, n)
            decode, d0 = c.pool("d0"), c.worker("d0")
            assert decode.counters.kv_blocks_received > 0
            assert decode.counters.kv_blocks_received == d0.kv_blocks_received
            assert c.worker("p0").send_tags == d0.receive_tags
            # Every request's first token came from the prefill worker, the rest from decode.
            prefill_sampled = {r for s in c.worker("p0").steps for r in s.sampled}
            assert prefill_sampled == {f"r{i}" for i in range(len(cases))}
            await assert_clean(c)

    run(scenario())


def test_two_decode_pools_share_the_requests():
    async def scenario():
        async with cluster(
            worker_info("p0", "prefill"),
            worker_info("d0", "decode"),
            worker_info("d1", "decode"),
        ) as c:
            cases = [(prompt(i, 5 + i), 10) for i in range(6)]
            handles = [submit(c, f"r{i}", p, n) for i, (p, n) in enumerate(cases)]
            streams = await asyncio.gather(*(collect(h.events) for h in handles))
            for stream, (p, n) in zip(streams, cases, strict=True):
                assert_exact(stream, p, n)
            d0, d1 = c.worker("d0").planned_request_ids, c.worker("d1").planned_request_ids
            assert d0 and d1 and not d0 & d1
            assert d0 | d1 == {f"r{i}" for i in range(6)}
            assert c.pool("d0").counters.kv_blocks_received > 0
            assert c.pool("d1").counters.kv_blocks_received > 0
            await assert_clean(c)

    run(scenario())


def test_decode_pool_reuses_its_prefix_cache():
    async def scenario():
        async with cluster(worker_info("p0", "prefill"), worker_info("d0", "decode")) as c:
            p = prompt(5, 13)  # three full blocks and one token
            first = await collect(submit(c, "a", p, 6).events)
            decode = c.pool("d0")
            received, reused = decode.counters.kv_blocks_received, decode.counters.kv_blocks_reused
            assert (received, reused) == (4, 0)
            second = await collect(submit(c, "b", p, 6).events)
            assert_exact(first, p, 6)
            assert_exact(second, p, 6)
            assert decode.counters.kv_blocks_reused == 3
            assert decode.counters.kv_blocks_received == received + 1  # the partial block
            assert second.finished.cached_tokens == 12  # the prefill pool's cache too
            await assert_clean(c)

    run(scenario())


# -- aborts --------------------------------------------------------------------------------
def test_abort_while_waiting():
    async def scenario():
        async with cluster(worker_info("p0", "prefill"), worker_info("d0", "decode")) as c:
            p = prompt(1, 9)
            handle = submit(c, "a", p, 5)
            assert c.engine.num_waiting == (1, 9)
            assert c.engine.abort("a") is True
            assert c.engine.abort("a") is False  # already gone
            stream = await collect(handle.events)
            assert_aborted(stream, p, 5)
            assert stream.tokens == [] and stream.finished.error is None
            assert c.engine.num_waiting == (0, 0)
            # The pool still serves.
            assert_exact(await collect(submit(c, "b", p, 5).events), p, 5)
            await assert_clean(c)
            assert "a" not in c.worker("p0").planned_request_ids

    run(scenario())


def test_abort_while_the_prompt_runs():
    async def scenario():
        async with cluster(worker_info("p0", "prefill"), worker_info("d0", "decode")) as c:
            p0 = c.worker("p0")
            p0.hold_steps()
            p = prompt(2, 11)
            handle = submit(c, "a", p, 5)
            await until(lambda: "a" in p0.planned_request_ids)
            assert c.engine.abort("a")
            stream = await collect(handle.events)
            assert_aborted(stream, p, 5)
            assert stream.tokens == []
            p0.release_steps()  # the step's token for "a" arrives after the abort: dropped
            await assert_clean(c)
            assert "a" not in c.worker("d0").planned_request_ids
            assert_exact(await collect(submit(c, "b", p, 5).events), p, 5)
            await assert_clean(c)

    run(scenario())


def test_abort_while_waiting_for_decode_room():
    async def scenario():
        async with cluster(
            worker_info("p0", "prefill"), worker_info("d0", "decode", num_blocks=4)
        ) as c:
            d0 = c.worker("d0")
            d0.step_delay_s = 0.003
            p_a, p_b = prompt(1, 8), prompt(2, 8)
            a = submit(c, "a", p_a, 6)  # holds 2..4 of d0's 4 blocks while it decodes
            await until(lambda: "a" in d0.planned_request_ids)
            b = submit(c, "b", p_b, 6)
            await until(lambda: b.stage is Stage.HANDOFF, what="b waits for decode room")
            assert c.engine.abort("b")
            assert_aborted(await collect(b.events), p_b, 6)
            assert_exact(await collect(a.events), p_a, 6)
            assert "b" not in d0.planned_request_ids
            await assert_clean(c)

    run(scenario())


def test_abort_during_transfer_cancels_the_receive_on_the_decode_worker():
    async def scenario():
        async with cluster(worker_info("p0", "prefill"), worker_info("d0", "decode")) as c:
            d0 = c.worker("d0")
            d0.hang_transfers()
            p = prompt(4, 10)
            handle = submit(c, "a", p, 5)
            await until(lambda: bool(d0.receives_in_progress), what="the receive started")
            (tag,) = d0.receive_tags
            assert c.engine.abort("a")
            stream = await collect(handle.events)
            assert_aborted(stream, p, 5)
            assert len(stream.tokens) == 1  # the prefill worker's token
            d0.hang_transfers(tags=[tag])  # only the dead receive stays stuck on the worker
            # The next step the decode worker gets carries the dead tag; the receive still
            # running on the worker stops there and writes nothing.
            assert_exact(await collect(submit(c, "b", prompt(5, 6), 5).events), prompt(5, 6), 5)
            assert tag in d0.cancelled_tags_received
            first_plan_after = next(s for s in d0.steps if s.cancelled_transfer_tags)
            assert first_plan_after.cancelled_transfer_tags == [tag]
            await until(lambda: not d0.receives_in_progress, what="the receive gave up")
            assert d0.kv_blocks_received == c.pool("d0").counters.kv_blocks_received
            await assert_clean(c)

    run(scenario())


def test_abort_while_decoding():
    async def scenario():
        async with cluster(worker_info("p0", "prefill"), worker_info("d0", "decode")) as c:
            c.worker("d0").step_delay_s = 0.002
            p = prompt(6, 7)
            handle = submit(c, "a", p, 200)
            seen: list[int] = []
            while len(seen) < 4:
                event = await asyncio.wait_for(handle.events.get(), 2)
                assert isinstance(event, Tokens)
                seen.extend(event.token_ids)
            assert c.engine.abort("a")
            rest = await collect(handle.events)
            stream = Stream(seen + rest.tokens, rest.finished)
            assert_aborted(stream, p, 200)
            assert len(stream.tokens) < 200
            await assert_clean(c)

    run(scenario())


def test_stale_receive_cannot_overwrite_blocks_reused_by_the_next_transfer():
    """Worst case of the tag protocol: the aborted request's KV load keeps running on the
    decode worker (its cancel has not reached it) and its data arrives right after
    a second transfer wrote the same, reused blocks, before any step was sent."""

    async def scenario():
        async with cluster(
            worker_info("p0", "prefill"),
            worker_info("p1", "prefill"),
            worker_info("d0", "decode", num_blocks=4),
        ) as c:
            p0, d0 = c.worker("p0"), c.worker("d0")
            p0.hang_transfers()
            p_a, p_b = prompt(60, 10), prompt(61, 10)  # three blocks each, of d0's four
            a = submit(c, "a", p_a, 4)
            await until(lambda: bool(d0.receives_in_progress), what="a's transfer started")
            (tag_a,) = d0.receive_tags
            assert "a" in p0.planned_request_ids
            p0.set_health("NOT_SERVING")  # b's prompt goes to p1
            await until(lambda: c.pool("p0").draining)
            assert c.engine.abort("a")
            assert_aborted(await collect(a.events), p_a, 4)

            async def stale_data_arrives(tag: int) -> None:
                if tag != tag_a:  # b's blocks are written; no step has reached d0 yet
                    p0.heal_transfers()
                    await until(lambda: tag_a not in d0.receives_in_progress)

            d0.after_kv_received = stale_data_arrives
            b = submit(c, "b", p_b, 4)
            stream = await collect(b.events)
            assert d0.kv_errors == []
            assert_exact(stream, p_b, 4)
            await assert_clean(c)

    run(scenario())


# -- requests a driver above the engine submits (Request.keep_kv, Engine.fork) ---------------
def test_a_request_that_keeps_its_kv_parks_where_it_decodes_and_children_fork_from_it():
    """Finished at the prefill worker, a `keep_kv` request's KV moves to the decode pool and
    parks there (its Finished comes then); a fork from it computes only its new token on
    the parent's blocks; a fork from a request that keeps nothing is refused; releasing
    frees every block."""

    async def scenario():
        async with cluster(worker_info("p0", "prefill"), worker_info("d0", "decode")) as c:
            p = prompt(4, 13)
            parent = Request("parent", list(p), 1, keep_kv=True, counted=False)
            (handle,) = c.engine.submit([parent])
            stream = await collect(handle.events)
            assert_exact(stream, p, 1)
            assert handle.stage is Stage.PARKED and handle.pool is c.pool("d0")
            held = c.pool("d0").blocks.num_held("parent")
            assert held == c.pool("d0").blocks.blocks_for_tokens(len(p)) > 0
            assert c.pool("p0").blocks.num_free_blocks == c.pool("p0").blocks.num_blocks
            # the child: the parent's prompt and token, its computed tokens the parent's
            child = Request(
                "child", list(p), 3, output_token_ids=list(stream.tokens),
                num_computed_tokens=len(p),
            )  # fmt: skip
            events = asyncio.Queue()
            c.engine.fork("parent", child, events)
            with pytest.raises(KeyError, match="keeps no KV"):
                c.engine.fork("child", Request("x", list(p), 2), asyncio.Queue())
            c.engine.release_kv("parent")
            with pytest.raises(KeyError, match="keeps no KV"):
                c.engine.fork("parent", Request("y", list(p), 2), asyncio.Queue())
            got = await collect(events)
            # the child's tokens continue the parent's output exactly, computed on d0 alone
            assert_exact(Stream(list(stream.tokens) + got.tokens, got.finished, None), p, 3)
            assert "child" in c.worker("d0").planned_request_ids
            assert "child" not in c.worker("p0").planned_request_ids
            await assert_clean(c)

    run(scenario())
