"""The scheduler holds a constrained request until its grammar compiled on every worker
(`services/scheduler/grammar_gate.py`), against fake workers in-process: held requests are
not scheduled while other requests run, a constraint is prepared once, a refused one ends
its requests with INVALID_ARGUMENT, an aborted held request leaves nothing behind, and a
rejoining worker makes the scheduler prepare again."""

from __future__ import annotations

import asyncio

import pytest

from common.structured_output import Constraint
from services.scheduler.request import FinishReason, Request
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
from tests.fake_worker import worker_info

pytestmark = pytest.mark.timeout(30)
REGEX = Constraint("regex", "[a-z]+")


def submit_constrained(c, rid: str, prompt_ids, max_tokens: int, constraint=REGEX, n: int = 1):
    samples = [
        Request(
            rid if n == 1 else f"{rid}/{i}",
            list(prompt_ids),
            max_tokens,
            structured=constraint,
            index=i,
        )  # fmt: skip
        for i in range(n)
    ]
    return c.engine.submit(samples)


def test_held_until_every_worker_compiled_while_others_run():
    async def scenario():
        async with cluster(worker_info("p", "prefill"), worker_info("d", "decode")) as c:
            for w in c.workers:
                w.prepare_gate = asyncio.Event()
            held = submit_constrained(c, "held", prompt(1, 9), 6, n=2)
            free = submit(c, "free", prompt(2, 7), 8)
            assert_exact(await collect(free.events), prompt(2, 7), 8)  # not stalled
            assert all(h.request.num_computed_tokens == 0 for h in held)
            assert all(h.request.grammar_pending for h in held)
            c.workers[0].prepare_gate.set()
            await asyncio.sleep(0.05)
            assert all(h.request.num_computed_tokens == 0 for h in held), "one worker pending"
            c.workers[1].prepare_gate.set()
            streams = await collect(held[0].events, samples=2)
            for stream in streams.values():
                assert stream.finished.reason is FinishReason.LENGTH
                assert len(stream.tokens) == 6
            assert [w.prepared for w in c.workers] == [[REGEX], [REGEX]]
            # Prepared everywhere: the next request under it is not held, nor prepared again.
            (again,) = submit_constrained(c, "again", prompt(3, 5), 4)
            assert not again.request.grammar_pending
            await collect(again.events)
            assert [len(w.prepared) for w in c.workers] == [1, 1]
            await assert_clean(c)

    run(scenario())


def test_refused_constraint_ends_its_requests_with_invalid_argument():
    async def scenario():
        async with cluster(worker_info("p", "prefill"), worker_info("d", "decode")) as c:
            c.workers[1].refuse_constraint = "regex: unsupported construct"
            handles = submit_constrained(c, "bad", prompt(4, 6), 5, n=3)
            streams = await collect(handles[0].events, samples=3)
            for stream in streams.values():
                assert stream.tokens == []
                assert stream.finished.reason is FinishReason.ABORT
                assert stream.finished.error == ("INVALID_ARGUMENT", "regex: unsupported construct")
            free = submit(c, "free", prompt(5, 6), 5)
            assert_exact(await collect(free.events), prompt(5, 6), 5)
            await assert_clean(c)

    run(scenario())


def test_abort_while_held_and_prepared_again_after_a_rejoin():
    async def scenario():
        async with cluster(worker_info("p", "prefill"), worker_info("d", "decode")) as c:
            gate = asyncio.Event()
            for w in c.workers:
                w.prepare_gate = gate
            (held,) = submit_constrained(c, "gone", prompt(6, 6), 5)
            assert c.engine.abort("gone")
            finished = await collect(held.events)
            assert finished.finished.reason is FinishReason.ABORT
            gate.set()
            await until(lambda: c.engine.grammars.num_holding == 0)
            await assert_clean(c)
            # The decode worker dies and comes back with nothing compiled.
            d = c.worker("d")
            d.kill()
            await until(lambda: not c.pool("d").healthy, what="failure noticed")
            d.revive()
            await until(lambda: c.pool("d").healthy, what="rejoined")
            (after,) = submit_constrained(c, "after", prompt(7, 6), 4)
            assert after.request.grammar_pending
            await collect(after.events)
            assert d.prepared == [REGEX]  # the new process compiled it
            assert c.worker("p").prepared == [REGEX, REGEX]
            await assert_clean(c)

    run(scenario())
