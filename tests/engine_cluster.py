"""The in-process scheduler harness: fake workers (`tests/fake_worker.py`) and an Engine over
them built as `bootstrap.connect` builds them (`cluster`), a request's collected stream, and
the checks every scenario ends with (`assert_exact`: the fake model's tokens and finish;
`assert_clean`: nothing leaks). Used by the tests/unit/*_inprocess.py modules."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

from services.scheduler.bootstrap import pool_scheduler
from services.scheduler.config import SchedulerConfig
from services.scheduler.engine import Engine, Resilience
from services.scheduler.handle import Finished, Tokens
from services.scheduler.pool import Pool
from services.scheduler.request import FinishReason, Request
from services.scheduler.worker_types import WorkerInfo
from tests.fake_model import VOCAB_SIZE, expected_tokens
from tests.fake_worker import FakeWorker, make_workers

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


def assert_aborted(stream: Stream, p: list[int], max_tokens: int) -> None:
    """An aborted stream: an ABORT finish after a prefix of the fake model's tokens."""
    assert stream.finished.reason is FinishReason.ABORT
    assert stream.finished.completion_tokens == len(stream.tokens)
    assert stream.tokens == expected_tokens(p, max_tokens)[: len(stream.tokens)]


def stop_case(p: list[int], at: int) -> int:
    """A token the fake model produces first at position >= `at` of this prompt's output."""
    out = expected_tokens(p, 60)
    for i in range(at, len(out)):
        if out[i] not in out[:i]:
            return out[i]
    raise AssertionError("no usable stop token")
