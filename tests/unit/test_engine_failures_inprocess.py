"""The scheduler's Engine against fake workers (harness: `tests/engine_cluster.py`) when
things go wrong or run short: workers that die and rejoin, transfers killed, timed out or
failing for good, draining workers, preemption under tiny pools, and admission errors;
every scenario ends with exact streams and nothing leaked. Public surface only, as in
`test_engine_inprocess.py`."""

from __future__ import annotations

import asyncio

import pytest

from services.scheduler.engine import InvalidRequestError, OverloadedError, Resilience
from services.scheduler.request import FinishReason
from services.scheduler.worker_types import WorkerUnavailableError
from tests.engine_cluster import (
    assert_clean,
    assert_exact,
    cluster,
    collect,
    prompt,
    run,
    submit,
    until,
)
from tests.fake_model import VOCAB_SIZE, expected_tokens
from tests.fake_worker import worker_info

pytestmark = pytest.mark.timeout(30)


# -- worker failures -----------------------------------------------------------------------
def test_decode_worker_dies_mid_stream_and_requests_finish_elsewhere():
    async def scenario():
        async with cluster(
            worker_info("p0", "prefill"),
            worker_info("d0", "decode"),
            worker_info("d1", "decode"),
        ) as c:
            d0, d1 = c.worker("d0"), c.worker("d1")
            d0.step_delay_s = d1.step_delay_s = 0.002
            cases = [(prompt(i, 3 + 2 * i), 30) for i in range(6)]
            handles = [submit(c, f"r{i}", p, n) for i, (p, n) in enumerate(cases)]
            await until(lambda: len(d0.batch) >= 2 and len(d0.steps) >= 5)
            victims = set(d0.batch)
            d0.kill()
            streams = await asyncio.gather(*(collect(h.events) for h in handles))
            for stream, (p, n) in zip(streams, cases, strict=True):
                assert_exact(stream, p, n)  # no token repeated, none missing
            assert c.engine.num_worker_failures == 1
            assert c.engine.num_restarted_requests >= len(victims)
            assert victims <= d1.planned_request_ids
            assert not c.pool("d0").healthy
            assert c.engine.serving
            await assert_clean(c)

    run(scenario())


def test_failed_worker_rejoins_when_it_comes_back():
    async def scenario():
        async with cluster(
            worker_info("p0", "prefill"),
            worker_info("d0", "decode"),
            worker_info("d1", "decode"),
        ) as c:
            d0, pool = c.worker("d0"), c.pool("d0")
            d0.kill()  # idle: the health checks find out
            await until(lambda: not pool.healthy, what="the monitor fails d0")
            assert c.engine.num_worker_failures == 1
            assert c.engine.serving  # d1 still decodes
            d0.revive()
            await until(lambda: pool.healthy, what="the monitor rejoins d0")
            assert d0.num_stream_opens == 2
            cases = [(prompt(i, 6), 8) for i in range(6)]
            handles = [submit(c, f"r{i}", p, n) for i, (p, n) in enumerate(cases)]
            streams = await asyncio.gather(*(collect(h.events) for h in handles))
            for stream, (p, n) in zip(streams, cases, strict=True):
                assert_exact(stream, p, n)
            assert d0.planned_request_ids, "the rejoined worker gets requests"
            assert c.engine.num_worker_failures == 1
            await assert_clean(c)

    run(scenario())


def test_only_worker_dies_then_rejoins_and_serves_again():
    async def scenario():
        async with cluster(worker_info("w0")) as c:
            w0, pool = c.worker("w0"), c.pool("w0")
            w0.step_delay_s = 0.002
            p = prompt(7, 5)
            handle = submit(c, "a", p, 100)
            await until(lambda: len(w0.steps) >= 3)
            w0.kill()
            stream = await collect(handle.events)
            assert stream.finished.reason is FinishReason.ABORT
            assert stream.finished.error is not None and stream.finished.error[0] == "UNAVAILABLE"
            assert stream.tokens == expected_tokens(p, 100)[: len(stream.tokens)]
            assert not c.engine.serving and c.serving_changes == [False]
            with pytest.raises(WorkerUnavailableError):
                submit(c, "refused", p, 5)
            w0.revive()
            await until(lambda: pool.healthy and c.engine.serving)
            assert c.serving_changes == [False, True]
            assert_exact(await collect(submit(c, "b", p, 12).events), p, 12)
            await assert_clean(c)

    run(scenario())


# -- failed and timed-out transfers --------------------------------------------------------
def test_prefill_worker_killed_mid_transfer_restarts_the_request_elsewhere():
    async def scenario():
        async with cluster(
            worker_info("p0", "prefill"),
            worker_info("p1", "prefill"),
            worker_info("d0", "decode"),
        ) as c:
            p0, p1, d0 = c.worker("p0"), c.worker("p1"), c.worker("d0")
            p0.hang_transfers()
            p1.hang_transfers()
            p = prompt(8, 10)
            handle = submit(c, "a", p, 6)
            await until(lambda: bool(d0.receives_in_progress), what="the transfer started")
            (tag,) = d0.receive_tags
            sender, survivor = (p0, p1) if p0.send_tags else (p1, p0)
            assert sender.send_tags == [tag]
            survivor.heal_transfers()
            sender.kill()
            stream = await collect(handle.events)
            assert_exact(stream, p, 6)
            assert c.engine.num_worker_failures == 1
            assert "a" in survivor.planned_request_ids
            # The failed transfer's tag reached the decode worker with a step.
            assert tag in d0.cancelled_tags_received
            await until(lambda: not d0.receives_in_progress)
            await assert_clean(c)

    run(scenario())


def test_decode_worker_killed_mid_transfer_restarts_the_request_elsewhere():
    async def scenario():
        async with cluster(
            worker_info("p0", "prefill"),
            worker_info("d0", "decode"),
            worker_info("d1", "decode"),
        ) as c:
            d0, d1 = c.worker("d0"), c.worker("d1")
            d0.hang_transfers()
            d1.hang_transfers()
            p = prompt(9, 10)
            handle = submit(c, "a", p, 6)
            await until(lambda: bool(d0.receives_in_progress or d1.receives_in_progress))
            dead, survivor = (d0, d1) if d0.receives_in_progress else (d1, d0)
            survivor.heal_transfers()
            dead.kill()
            stream = await collect(handle.events)
            assert_exact(stream, p, 6)
            assert c.engine.num_worker_failures == 1
            assert c.engine.num_restarted_requests == 1
            assert "a" in survivor.planned_request_ids
            await assert_clean(c)

    run(scenario())


def test_transfer_timeout_restarts_the_request_without_failing_a_worker():
    async def scenario():
        async with cluster(
            worker_info("p0", "prefill"), worker_info("d0", "decode"), kv_transfer_timeout_s=0.1
        ) as c:
            d0 = c.worker("d0")
            d0.hang_transfers()
            p = prompt(10, 9)
            handle = submit(c, "a", p, 5)
            await until(lambda: c.engine.num_restarted_requests == 1, what="timed out")
            d0.heal_transfers()
            stream = await collect(handle.events)
            assert_exact(stream, p, 5)
            assert c.engine.num_worker_failures == 0
            assert len(d0.receive_tags) == 2 and d0.receive_tags[0] in d0.cancelled_tags_received
            await assert_clean(c)

    run(scenario())


def test_transfers_that_keep_failing_end_the_request_after_max_restarts():
    async def scenario():
        resilience = Resilience(
            health_interval_s=0.01, health_timeout_s=0.05, health_max_misses=2, max_restarts=2
        )
        async with cluster(
            worker_info("p0", "prefill"), worker_info("d0", "decode"), resilience=resilience
        ) as c:
            c.worker("d0").fail_transfers()
            p = prompt(11, 9)
            stream = await collect(submit(c, "a", p, 5).events)
            assert stream.finished.reason is FinishReason.ABORT
            assert stream.finished.error[0] == "UNAVAILABLE"
            assert "restarts" in stream.finished.error[1]
            assert stream.tokens == expected_tokens(p, 5)[: len(stream.tokens)]
            assert c.engine.num_worker_failures == 0
            c.worker("d0").heal_transfers()
            assert_exact(await collect(submit(c, "b", p, 5).events), p, 5)
            await assert_clean(c)

    run(scenario())


# -- draining ------------------------------------------------------------------------------
def test_draining_worker_gets_no_new_requests_and_finishes_its_own():
    async def scenario():
        async with cluster(worker_info("w0"), worker_info("w1")) as c:
            w0, w1 = c.worker("w0"), c.worker("w1")
            w0.hold_steps()
            p0 = prompt(12, 6)
            first = submit(c, "first", p0, 10)
            await until(
                lambda: "first" in w0.planned_request_ids or "first" in w1.planned_request_ids
            )
            assert "first" in w0.planned_request_ids  # an empty cluster starts with w0
            w0.set_health("NOT_SERVING")
            await until(lambda: c.pool("w0").draining, what="the monitor sees w0 draining")
            assert c.engine.serving
            cases = [(prompt(20 + i, 5), 6) for i in range(5)]
            handles = [submit(c, f"r{i}", p, n) for i, (p, n) in enumerate(cases)]
            w0.release_steps()
            streams = await asyncio.gather(*(collect(h.events) for h in handles))
            for stream, (p, n) in zip(streams, cases, strict=True):
                assert_exact(stream, p, n)
            assert_exact(await collect(first.events), p0, 10)  # it finished on w0
            assert w0.planned_request_ids == {"first"}
            assert {f"r{i}" for i in range(5)} <= w1.planned_request_ids
            w0.set_health("SERVING")
            await until(lambda: not c.pool("w0").draining)
            await assert_clean(c)

    run(scenario())


def test_draining_decode_worker_gets_no_handoffs():
    async def scenario():
        async with cluster(
            worker_info("p0", "prefill"),
            worker_info("d0", "decode"),
            worker_info("d1", "decode"),
        ) as c:
            c.worker("d0").set_health("NOT_SERVING")
            await until(lambda: c.pool("d0").draining)
            cases = [(prompt(30 + i, 7), 6) for i in range(4)]
            handles = [submit(c, f"r{i}", p, n) for i, (p, n) in enumerate(cases)]
            streams = await asyncio.gather(*(collect(h.events) for h in handles))
            for stream, (p, n) in zip(streams, cases, strict=True):
                assert_exact(stream, p, n)
            assert not c.worker("d0").planned_request_ids
            await assert_clean(c)

    run(scenario())


def test_a_drain_is_learned_from_the_next_step_result():
    """Health checks every minute: only the step results (`draining`) can tell the engine
    that d0 drains. Its requests move to d1 with their KV, a step or two later."""

    async def scenario():
        slow = Resilience(health_interval_s=60.0, health_timeout_s=1.0, health_max_misses=2)
        async with cluster(
            worker_info("p0", "prefill"),
            worker_info("d0", "decode"),
            worker_info("d1", "decode"),
            resilience=slow,
        ) as c:
            d0, d1 = c.worker("d0"), c.worker("d1")
            cases = [(prompt(60 + i, 6), 40) for i in range(4)]
            handles = [submit(c, f"r{i}", p, n) for i, (p, n) in enumerate(cases)]
            await until(lambda: len(d0.batch) >= 1 and len(d0.steps) >= 3)
            held = set(d0.batch)
            d0.hold_steps()
            d0.set_health("NOT_SERVING")  # no health check comes for a minute
            d0.release_steps()
            streams = await asyncio.gather(*(collect(h.events) for h in handles))
            for stream, (p, n) in zip(streams, cases, strict=True):
                assert_exact(stream, p, n)
            assert c.pool("d0").draining and not c.pool("d1").draining
            assert held <= d1.planned_request_ids  # moved, KV and all
            assert c.pool("d0").scheduler.num_migrations_out >= len(held)
            await assert_clean(c)

    run(scenario())


def test_every_prompt_worker_draining_stops_serving():
    async def scenario():
        async with cluster(worker_info("w0")) as c:
            c.worker("w0").set_health("NOT_SERVING")
            await until(lambda: not c.engine.serving)
            assert c.serving_changes == [False]
            with pytest.raises(WorkerUnavailableError):
                submit(c, "a", prompt(1, 3), 3)
            c.worker("w0").set_health("SERVING")
            await until(lambda: c.engine.serving)
            assert_exact(await collect(submit(c, "b", prompt(1, 3), 3).events), prompt(1, 3), 3)
            await assert_clean(c)

    run(scenario())


# -- preemption ----------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_under_a_tiny_block_pool_keeps_exact_streams(mode):
    async def scenario():
        info = worker_info("w0", num_blocks=10, num_swap_blocks=32 if mode == "swap" else 0)
        async with cluster(info, preemption_mode=mode) as c:
            # Certain: all 4 are submitted before the engine runs a step, their 20 prompt
            # tokens fit one step's budget (64), and one worker runs every step: they
            # decode side by side, to 5 blocks each (19 tokens): 20 blocks in 10.
            cases = [(prompt(40 + i, 5), 14) for i in range(4)]
            handles = [submit(c, f"r{i}", p, n) for i, (p, n) in enumerate(cases)]
            streams = await asyncio.gather(*(collect(h.events) for h in handles))
            for stream, (p, n) in zip(streams, cases, strict=True):
                assert_exact(stream, p, n)
            scheduler = c.pool("w0").scheduler
            assert scheduler.num_preemptions > 0
            if mode == "swap":
                assert scheduler.num_swap_outs > 0
            await assert_clean(c)

    run(scenario())


def test_decode_pool_preemption_recomputes_through_the_prefill_pool():
    async def scenario():
        async with cluster(
            worker_info("p0", "prefill"), worker_info("d0", "decode", num_blocks=8)
        ) as c:
            # Certain: the 3 prompts run in the first prefill step and reach d0 together (2
            # blocks each: 6 of 8), then decode side by side to 5 blocks each: 15 in 8.
            cases = [(prompt(50 + i, 5), 14) for i in range(3)]
            handles = [submit(c, f"r{i}", p, n) for i, (p, n) in enumerate(cases)]
            streams = await asyncio.gather(*(collect(h.events) for h in handles))
            for stream, (p, n) in zip(streams, cases, strict=True):
                assert_exact(stream, p, n)
            assert c.pool("d0").scheduler.num_preemptions > 0
            await assert_clean(c)

    run(scenario())


def test_a_request_preempted_out_of_a_worker_that_then_dies_does_not_wait_for_its_lost_token():
    """Forced: d0's steps are held, so the token its first decode step samples for every
    request is still on the way when its next plan runs out of blocks and preempts one
    (recompute: back to p0's queue, where a request waits for a token on the way before it
    is recomputed). d0 then dies with that step unanswered: the token will never come, and
    the preempted request must not wait for it (it waited forever: a fresh clone's run of
    `test_e2e_architecture_paths` hung one stream until its deadline)."""

    async def scenario():
        async with cluster(
            worker_info("p0", "prefill"),
            worker_info("d0", "decode", num_blocks=7),
            worker_info("d1", "decode"),
        ) as c:
            d0, d1 = c.worker("d0"), c.worker("d1")
            d1.kill()  # every hand-off goes to d0 until d1 comes back
            await until(lambda: not c.pool("d1").healthy, what="the monitor fails d1")
            d0.hold_steps()
            # 7-token prompts: 8 tokens (2 blocks of 4) each when they reach d0 (6 of 7
            # blocks). Its first step computes position 7 (no block needed) and samples
            # token 9, still on the way (held) when the second step needs a third block
            # for each: one request is preempted with that token pending.
            cases = [(prompt(70 + i, 7), 12) for i in range(3)]
            handles = [submit(c, f"r{i}", p, n) for i, (p, n) in enumerate(cases)]
            scheduler = c.pool("d0").scheduler
            await until(lambda: scheduler.num_preemptions > 0, what="d0 preempts")
            waiting = c.pool("p0").scheduler.waiting
            assert [r.num_pending_tokens for r in waiting] == [1]  # the race, forced
            d1.revive()
            await until(lambda: c.pool("d1").healthy, what="the monitor rejoins d1")
            assert [r.num_pending_tokens for r in waiting] == [1]  # still on the way
            d0.kill()
            streams = await asyncio.gather(*(collect(h.events) for h in handles))
            for stream, (p, n) in zip(streams, cases, strict=True):
                assert_exact(stream, p, n)
            assert c.engine.num_worker_failures == 2
            await assert_clean(c)

    run(scenario())


# -- admission -----------------------------------------------------------------------------
def test_full_queue_is_overloaded():
    async def scenario():
        resilience = Resilience(max_waiting_requests=2, max_waiting_tokens=12)
        async with cluster(worker_info("w0"), resilience=resilience) as c:
            a = submit(c, "a", prompt(1, 8), 3)
            with pytest.raises(OverloadedError, match="max_waiting_tokens"):
                submit(c, "b", prompt(2, 5), 3)  # 8 + 5 tokens > 12
            b = submit(c, "b", prompt(2, 4), 3)
            with pytest.raises(OverloadedError, match="max_waiting_requests"):
                submit(c, "c", prompt(3, 1), 3)
            assert c.engine.num_rejected_requests == 2
            assert c.engine.num_requests == 2
            assert_exact(await collect(a.events), prompt(1, 8), 3)
            assert_exact(await collect(b.events), prompt(2, 4), 3)
            # Room again once the queue drained.
            assert_exact(await collect(submit(c, "c", prompt(3, 1), 3).events), prompt(3, 1), 3)
            await assert_clean(c)

    run(scenario())


def test_bad_requests_are_invalid_and_leave_nothing_behind():
    async def scenario():
        async with cluster(worker_info("w0"), max_model_len=64) as c:
            bad = [
                ([], 3, "must not be empty"),
                ([1, VOCAB_SIZE], 3, "prompt_token_ids must be in"),
                ([1, -1], 3, "prompt_token_ids must be in"),
                ([1, 2], 0, "max_tokens must be >= 1"),
                (prompt(1, 40), 30, "max_model_len=64"),
            ]
            for i, (p, n, message) in enumerate(bad):
                with pytest.raises(InvalidRequestError, match=message):
                    submit(c, f"bad{i}", p, n)
            c.worker("w0").hold_steps()
            running = submit(c, "dup", prompt(1, 4), 3)
            with pytest.raises(InvalidRequestError, match="already running"):
                submit(c, "dup", prompt(1, 4), 3)
            assert c.engine.num_requests == 1 and c.engine.num_rejected_requests == 0
            c.worker("w0").release_steps()
            assert_exact(await collect(running.events), prompt(1, 4), 3)
            await assert_clean(c)

    run(scenario())


def test_cancels_arriving_with_every_step_slot_taken_wait_for_a_result_without_spinning():
    """A decode pool with both steps in flight (its worker holds them) learns of cancelled
    receives: their tags go with the next plan, once a result frees a slot. Before, the
    pool loop returned at once to plan, found no free slot, and returned again, without
    ever yielding: the event loop (and so the very result it waited for) froze."""

    async def scenario():
        async with cluster(worker_info("p0", "prefill"), worker_info("d0", "decode")) as c:
            d0, pool = c.worker("d0"), c.pool("d0")
            d0.hold_steps()
            p = prompt(7, 5)
            handle = submit(c, "a", p, 2)  # one decode step, then nothing left to plan
            # Its KV arrived (the load's await plan answered) and its decode step is held.
            await until(
                lambda: (
                    "a" in d0.planned_request_ids
                    and pool.scheduler.num_steps_in_flight == 1
                    and pool.receiving
                )
            )
            pool.scheduler.peer_loads.cancel(0xA1, "nobody")  # frees a plan with the tag
            pool.wakeup.set()
            await until(lambda: pool.scheduler.num_steps_in_flight == 2, what="second plan")
            pool.scheduler.peer_loads.cancel(0xA2, "nobody")  # no slot left now
            pool.wakeup.set()
            await asyncio.sleep(0.05)  # froze here before
            d0.release_steps()
            assert_exact(await collect(handle.events), p, 2)
            assert [0xA1, 0xA2] == [t for t in d0.cancelled_tags_received if t in (0xA1, 0xA2)]
            await assert_clean(c)

    run(scenario())


def test_a_worker_that_restarts_between_two_health_checks_is_rejoined_not_used_stale():
    """Drained and restarted within the health checks' window (never UNREACHABLE to the
    monitor): its health answer's boot id differs from the one it described, so the
    monitor fails and rejoins it at once (a fresh step stream) and the next request is
    served, instead of failing UNAVAILABLE on the old process's dead stream."""

    async def scenario():
        async with cluster(worker_info("w0")) as c:
            w0, pool = c.worker("w0"), c.pool("w0")
            p = prompt(3, 5)
            assert_exact(await collect(submit(c, "before", p, 4).events), p, 4)
            await until(lambda: not pool.scheduler.num_steps_in_flight, what="w0 idle")
            boot = pool.info.boot_id
            w0.kill()
            w0.revive()  # no await between: no health check saw it gone
            await until(lambda: w0.num_stream_opens == 2, what="the monitor rejoins w0")
            assert pool.healthy and pool.info.boot_id not in ("", boot)
            assert c.engine.num_worker_failures == 1
            assert_exact(await collect(submit(c, "after", p, 6).events), p, 6)
            await assert_clean(c)

    run(scenario())
