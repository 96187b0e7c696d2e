"""Speculative decoding's scheduling, in-process against fake workers whose verify pass
accepts a varying number of proposals (and writes the rejected ones' wrong KV, as a real
pass does): exact streams, never more than max_tokens or the context, stop tokens among
accepted proposals, async scheduling, prefix hits, preemption (recompute and swap),
aborts, a killed decode worker, the batch-size switch, the counts in GetPoolStats'
counters and a sample's usage, and no leaked block."""

from __future__ import annotations

import asyncio

import pytest

from services.scheduler.request import FinishReason
from tests.engine_cluster import (
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
from tests.fake_model import expected_tokens
from tests.fake_worker import worker_info

pytestmark = pytest.mark.timeout(30)


def spec_decode(worker_id: str, k: int = 4, **kwargs):
    return worker_info(worker_id, "decode", speculative_tokens=k, **kwargs)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_streams_are_exact_and_several_tokens_land_per_step(async_scheduling):
    async def scenario():
        async with cluster(
            worker_info("p0", "prefill"), spec_decode("d0"), async_scheduling=async_scheduling
        ) as c:
            cases = [
                (prompt(i, length), n)
                for i, (length, n) in enumerate(
                    [(1, 1), (3, 2), (5, 3), (8, 6), (13, 17), (21, 40)]
                )
            ]
            handles = [submit(c, f"r{i}", p, n) for i, (p, n) in enumerate(cases)]
            streams = await asyncio.gather(*(collect(h.events) for h in handles))
            for stream, (p, n) in zip(streams, cases, strict=True):
                assert_exact(stream, p, n)  # in order, no gap, no repeat, never past n
            d0, counters = c.worker("d0"), c.pool("d0").scheduler.spec_decode
            assert d0.proposed_tokens > 0
            assert counters.num_draft_tokens == d0.proposed_tokens
            assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
            # Fewer decode steps than tokens: accepted proposals saved passes.
            decode_tokens = sum(n - 1 for _, n in cases)
            decode_steps = sum(len(s.scheduled) for s in d0.steps)
            assert decode_steps < decode_tokens
            usage = [s.finished for s in streams]
            assert sum(f.num_draft_tokens for f in usage) == counters.num_draft_tokens
            assert sum(f.num_accepted_tokens for f in usage) == counters.num_accepted_tokens
            await assert_clean(c)

    run(scenario())


def test_a_stop_token_among_accepted_proposals_ends_the_request_there():
    async def scenario():
        async with cluster(worker_info("p0", "prefill"), spec_decode("d0", k=6)) as c:
            cases = []
            for i in range(6):
                p = prompt(30 + i, 4 + i)
                cases.append((p, stop_case(p, 3 + i)))
            handles = [submit(c, f"s{i}", p, 60, stop=[s]) for i, (p, s) in enumerate(cases)]
            streams = await asyncio.gather(*(collect(h.events) for h in handles))
            for stream, (p, s) in zip(streams, cases, strict=True):
                assert_exact(stream, p, 60, [s])
                assert stream.finished.reason is FinishReason.STOP
            await assert_clean(c)

    run(scenario())


def test_lookahead_stops_at_the_end_of_the_context():
    async def scenario():
        async with cluster(
            worker_info("p0", "prefill", max_model_len=24),
            spec_decode("d0", k=8, max_model_len=24),
            max_model_len=24,
        ) as c:
            p = prompt(7, 10)
            stream = await collect(submit(c, "ctx", p, 24 - 10).events)
            assert stream.tokens == expected_tokens(p, 24 - 10)  # to the context's end
            assert stream.finished.reason is FinishReason.LENGTH
            assert c.pool("d0").scheduler.spec_decode.num_accepted_tokens > 0
            await assert_clean(c)

    run(scenario())


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_proposals_in_flight_keeps_exact_streams(mode):
    async def scenario():
        swap = 32 if mode == "swap" else 0
        decode = spec_decode("d0", num_blocks=9, num_swap_blocks=swap)
        prefill = worker_info("p0", "prefill", num_swap_blocks=swap)
        async with cluster(prefill, decode, preemption_mode=mode) as c:
            # Certain: the 4 prompts run in the first prefill step and reach d0 together (2
            # blocks each: 8 of 9), then decode side by side (proposals only take more)
            # to 6 blocks each: 24 blocks in 9.
            cases = [(prompt(60 + i, 5), 18) for i in range(4)]
            handles = [submit(c, f"r{i}", p, n) for i, (p, n) in enumerate(cases)]
            streams = await asyncio.gather(*(collect(h.events) for h in handles))
            for stream, (p, n) in zip(streams, cases, strict=True):
                assert_exact(stream, p, n)
            scheduler = c.pool("d0").scheduler
            assert scheduler.num_preemptions > 0
            assert scheduler.spec_decode.num_accepted_tokens > 0
            if mode == "swap":
                assert scheduler.num_swap_outs > 0
            await assert_clean(c)

    run(scenario())


def test_a_prefix_hit_on_the_decode_pool_keeps_exact_streams():
    async def scenario():
        async with cluster(worker_info("p0", "prefill"), spec_decode("d0")) as c:
            shared = prompt(70, 12)
            first = await collect(submit(c, "a", shared, 20).events)
            assert_exact(first, shared, 20)
            again = await collect(submit(c, "b", shared + [5, 6], 20).events)
            assert_exact(again, shared + [5, 6], 20)
            assert c.pool("d0").counters.kv_blocks_reused > 0
            await assert_clean(c)

    run(scenario())


def test_abort_while_proposals_are_verified():
    async def scenario():
        async with cluster(worker_info("p0", "prefill"), spec_decode("d0")) as c:
            d0 = c.worker("d0")
            d0.step_delay_s = 0.01
            p = prompt(80, 6)
            handle = submit(c, "a", p, 200)
            await until(lambda: d0.proposed_tokens > 0, what="verifying")
            assert c.engine.abort("a")
            assert_aborted(await collect(handle.events), p, 200)
            await assert_clean(c)

    run(scenario())


def test_a_killed_decode_worker_mid_speculation_restarts_its_requests_elsewhere():
    async def scenario():
        async with cluster(worker_info("p0", "prefill"), spec_decode("d0"), spec_decode("d1")) as c:
            d0, d1 = c.worker("d0"), c.worker("d1")
            d0.step_delay_s = d1.step_delay_s = 0.002
            cases = [(prompt(90 + i, 3 + 2 * i), 40) for i in range(6)]
            handles = [submit(c, f"r{i}", p, n) for i, (p, n) in enumerate(cases)]
            await until(lambda: len(d0.batch) >= 2 and d0.proposed_tokens > 8)
            d0.kill()
            streams = await asyncio.gather(*(collect(h.events) for h in handles))
            for stream, (p, n) in zip(streams, cases, strict=True):
                assert_exact(stream, p, n)
            assert c.engine.num_worker_failures == 1
            await assert_clean(c)

    run(scenario())


def test_no_lookahead_at_or_above_disable_by_batch_size():
    async def scenario():
        async with cluster(
            worker_info("p0", "prefill"), spec_decode("d0", disable_by_batch_size=3)
        ) as c:
            c.worker("d0").step_delay_s = 0.003
            scheduler = c.pool("d0").scheduler
            plans = []  # (running requests when planned, lookahead slots planned)
            schedule = scheduler.schedule

            def recorded():
                before = len(scheduler.running)
                plan = schedule()
                plans.append((before, sum(s.num_lookahead_tokens for s in plan.scheduled)))
                return plan

            scheduler.schedule = recorded
            cases = [(prompt(100 + i, 4), 12 + 6 * i) for i in range(4)]
            handles = [submit(c, f"r{i}", p, n) for i, (p, n) in enumerate(cases)]
            streams = await asyncio.gather(*(collect(h.events) for h in handles))
            for stream, (p, n) in zip(streams, cases, strict=True):
                assert_exact(stream, p, n)
            assert any(running >= 3 for running, _ in plans)  # the switch was tested
            assert all(slots == 0 for running, slots in plans if running >= 3)
            assert any(slots > 0 for running, slots in plans if running < 3)
            await assert_clean(c)

    run(scenario())
