"""The scheduler's Engine, KvHandoff and PoolMonitor in-process, against fake workers
(`tests/fake_worker.py`): exact token streams, finish reasons, hand-offs, aborts in every
stage, worker failures and rejoins, failed and cancelled transfers, draining, preemption,
and admission errors; after each scenario nothing leaks (every block free, every worker's
batch empty, the engine's integrity check clean).

Only the Engine's public surface is used: the constructor, start, submit, abort, the
events of each request (Tokens / Finished), check_integrity, close, the pools' counters,
health flags, block managers and scheduler queues, the engine's counters, and (once) a
handle's stage. Engine internals (`_apply`, the hand-off's pumping) are not touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from services.scheduler.bootstrap import pool_scheduler
from services.scheduler.config import SchedulerConfig
from services.scheduler.engine import Engine, InvalidRequestError, OverloadedError, Resilience
from services.scheduler.handle import Finished, Stage, Tokens
from services.scheduler.pool import Pool
from services.scheduler.request import FinishReason, Request
from services.scheduler.worker_types import WorkerInfo, WorkerUnavailableError
from tests.fake_worker import VOCAB_SIZE, FakeWorker, expected_tokens, make_workers, worker_info

pytestmark = pytest.mark.timeout(30)

# Health checks every 10 ms; two misses fail a worker.
FAST = Resilience(health_interval_s=0.01, health_timeout_s=0.05, health_max_misses=2)


def run(coro, timeout_s: float = 10.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 97 + k * 13 + 5) % VOCAB_SIZE for k in range(length)]


@dataclass
class Cluster:
    engine: Engine
    workers: list[FakeWorker]
    serving_changes: list[bool] = field(default_factory=list)

    def worker(self, worker_id: str) -> FakeWorker:
        return next(w for w in self.workers if w.info.worker_id == worker_id)

    def pool(self, worker_id: str) -> Pool:
        return next(p for p in self.engine.pools if p.info.worker_id == worker_id)


@contextlib.asynccontextmanager
async def cluster(
    *infos: WorkerInfo,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    preemption_mode: str = "recompute",
    async_scheduling: bool = True,
    resilience: Resilience = FAST,
    kv_transfer_timeout_s: float = 2.0,
    max_model_len: int = 512,
    kv_transfer_streaming: bool = True,
):
    """Fake workers and an Engine over them, built as `bootstrap.connect` builds them."""
    config = SchedulerConfig(
        workers=tuple(i.address for i in infos),
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        preemption_mode=preemption_mode,
        async_scheduling=async_scheduling,
    )
    workers = make_workers(*infos)
    pools = []
    for worker, info in zip(workers, infos, strict=True):
        await worker.open_step_stream()
        pools.append(Pool(info=info, client=worker, scheduler=pool_scheduler(config, info)))
    changes: list[bool] = []
    engine = Engine(
        pools,
        max_model_len=max_model_len,
        vocab_size=VOCAB_SIZE,
        deployment_salt=b"in-process-tests",
        kv_transfer_timeout_s=kv_transfer_timeout_s,
        kv_transfer_streaming=kv_transfer_streaming,
        async_scheduling=async_scheduling,
        resilience=resilience,
        make_scheduler=functools.partial(pool_scheduler, config),
        on_serving_change=changes.append,
    )
    engine.start()
    try:
        yield Cluster(engine, workers, changes)
    finally:
        await engine.close()


@dataclass
class Stream:
    tokens: list[int]
    finished: Finished
    first_cached_tokens: int | None = None


async def collect(events: asyncio.Queue, samples: int = 1, timeout_s: float = 5.0):
    """Read a client request's events until each of its samples finished; returns the
    stream of sample 0 (or, for n > 1, a dict index -> Stream)."""
    tokens: dict[int, list[int]] = {i: [] for i in range(samples)}
    first_cached: dict[int, int | None] = {}
    finished: dict[int, Finished] = {}
    async with asyncio.timeout(timeout_s):
        while len(finished) < samples:
            event = await events.get()
            assert event.index not in finished, f"event after Finished: {event}"
            if isinstance(event, Tokens):
                if not tokens[event.index]:
                    first_cached[event.index] = event.cached_tokens
                tokens[event.index].extend(event.token_ids)
            else:
                assert isinstance(event, Finished)
                finished[event.index] = event
    streams = {i: Stream(tokens[i], finished[i], first_cached.get(i)) for i in range(samples)}
    return streams[0] if samples == 1 else streams


def submit(c: Cluster, rid: str, prompt_ids: list[int], max_tokens: int, stop=()):
    request = Request(rid, list(prompt_ids), max_tokens, stop_token_ids=frozenset(stop))
    (handle,) = c.engine.submit([request])
    return handle


async def until(predicate: Callable[[], bool], timeout_s: float = 3.0, what: str = "") -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.001)
    assert predicate(), what


def assert_exact(stream: Stream, prompt_ids, max_tokens, stop=()) -> None:
    expected = expected_tokens(prompt_ids, max_tokens, stop)
    assert stream.tokens == expected
    reason = FinishReason.STOP if stop and expected[-1] in stop else FinishReason.LENGTH
    assert stream.finished.reason is reason
    assert stream.finished.error is None
    assert stream.finished.completion_tokens == len(expected)
    assert stream.finished.prompt_tokens == len(prompt_ids)


async def assert_clean(c: Cluster) -> None:
    """Nothing leaks: no request left, every block of every pool free, the integrity check
    clean, no worker saw a bad plan or wrong KV, every live worker's batch emptied."""
    engine = c.engine
    assert engine.num_requests == 0
    for w in c.workers:
        assert w.plan_errors == [], w.info.worker_id
        assert w.kv_errors == [], w.info.worker_id
    live = [(p, c.worker(p.info.worker_id)) for p in engine.pools if p.healthy]
    await until(lambda: all(w.is_idle for _, w in live), what="the drops reach every worker")
    assert engine.check_integrity() == []
    for pool in engine.pools:
        name = pool.info.worker_id
        assert pool.blocks.num_free_blocks == pool.blocks.num_blocks, f"{name} leaks blocks"
        assert pool.blocks.num_requests == 0, name
        s = pool.scheduler
        assert not (s.running or s.waiting or s.swapped), name


def stop_case(p: list[int], at: int) -> int:
    """A token the fake model produces first at position >= `at` of this prompt's output."""
    out = expected_tokens(p, 60)
    for i in range(at, len(out)):
        if out[i] not in out[:i]:
            return out[i]
    raise AssertionError("no usable stop token")


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
            samples = [leader, Request("n-1", p, 8, index=1, leader=leader)]
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
def assert_aborted(stream: Stream, p: list[int], max_tokens: int) -> None:
    assert stream.finished.reason is FinishReason.ABORT
    assert stream.finished.completion_tokens == len(stream.tokens)
    assert stream.tokens == expected_tokens(p, max_tokens)[: len(stream.tokens)]


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
    """Worst case of the tag protocol: the aborted request's ReceiveKv keeps running on the
    decode worker (its cancel has not reached the handler) and its data arrives right after
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
            cases = [(prompt(40 + i, 5), 14) for i in range(4)]  # 5 blocks each at the end
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
            cases = [(prompt(50 + i, 5), 14) for i in range(3)]
            handles = [submit(c, f"r{i}", p, n) for i, (p, n) in enumerate(cases)]
            streams = await asyncio.gather(*(collect(h.events) for h in handles))
            for stream, (p, n) in zip(streams, cases, strict=True):
                assert_exact(stream, p, n)
            assert c.pool("d0").scheduler.num_preemptions > 0
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
            await until(lambda: pool.scheduler.num_steps_in_flight == 1 and pool.receiving)
            pool.scheduler.cancel_transfer(0xA1, "nobody")  # frees a plan with the tag
            pool.wakeup.set()
            await until(lambda: pool.scheduler.num_steps_in_flight == 2, what="second plan")
            pool.scheduler.cancel_transfer(0xA2, "nobody")  # no slot left now
            pool.wakeup.set()
            await asyncio.sleep(0.05)  # froze here before
            d0.release_steps()
            assert_exact(await collect(handle.events), p, 2)
            assert [0xA1, 0xA2] == [t for t in d0.cancelled_tags_received if t in (0xA1, 0xA2)]
            await assert_clean(c)

    run(scenario())
