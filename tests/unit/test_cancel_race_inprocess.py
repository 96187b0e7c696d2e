"""A client's cancel that lands while the engine awaits a step's send (issue 40): the
cancelled request ends ABORT with no error, its neighbours in the same pool and the same
plan go on exact, and nothing leaks. The cancel is injected at that moment, not hoped for:
the fake worker's `during_send` hook runs while `send_step` is awaited, and aborts the
victim when the plan being sent carries it as a prompt chunk, a prompt's last chunk, a
decode step or a beam step. The storm at the end cancels many requests at random sends
(seeded), on every kind of step at once.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import pytest

from common.pb.tandem.internal.v1 import scheduler_pb2
from services.scheduler.beam_driver import BeamDriver
from services.scheduler.handle import Finished, Tokens
from services.scheduler.request import FinishReason, Request
from services.scheduler.server import SchedulerServicer, beam_template_from_pb
from services.scheduler.session import SessionState
from tests.engine_cluster import (
    Cluster,
    assert_aborted,
    assert_clean,
    assert_exact,
    cluster,
    collect,
    prompt,
    run,
    submit,
)
from tests.fake_model import expected_tokens
from tests.fake_worker import worker_info
from tests.unit.test_beam_search_inprocess import beam_submit, reference

pytestmark = pytest.mark.timeout(30)


def start_search(c: Cluster, rid: str, p, k: int, n: int, max_tokens: int) -> BeamDriver:
    """A beam search driven over the cluster's engine; its results in `.events`."""
    template, params = beam_template_from_pb(beam_submit(rid, p, k, n, max_tokens), 512)
    search = BeamDriver(c.engine, template, params, asyncio.Queue())
    search.start()
    return search


def cancel_during_send(
    c: Cluster, worker_id: str, victim: str, when: Callable, abort: Callable | None = None
) -> list[int]:
    """Abort `victim` inside the send of the first plan to `worker_id` whose scheduled item
    for it satisfies `when(item)` (with `abort()` when given: a beam search's driver);
    returns a list that gets that step's number."""
    hits: list[int] = []

    async def hook(plan) -> None:
        if hits:
            return
        for item in plan.scheduled:
            rid = item.request.request_id
            if (rid == victim or rid.startswith(f"{victim}#")) and when(item):
                hits.append(c.worker(worker_id).last_sent_step_id)
                if abort is not None:
                    abort()
                else:
                    assert c.engine.abort(victim)
                await asyncio.sleep(0)  # the rest of the send happens after the abort
                return

    c.worker(worker_id).during_send = hook
    return hits


async def neighbours_and_victim(c: Cluster, worker_id: str, when, victim_prompt=40):
    """Two neighbours queued before the victim and two after, all on the same pools; the
    victim is cancelled during a send (`when`); everyone else must finish exact."""
    hits = cancel_during_send(c, worker_id, "x", when)
    cases = {f"y{i}": (prompt(10 + i, 6 + 3 * i), 12) for i in range(4)}
    handles = {rid: submit(c, rid, p, n) for rid, (p, n) in list(cases.items())[:2]}
    x_prompt = prompt(3, victim_prompt)
    victim = submit(c, "x", x_prompt, 24)
    handles |= {rid: submit(c, rid, p, n) for rid, (p, n) in list(cases.items())[2:]}
    stopped = await collect(victim.events)
    assert hits, "the cancel was injected during a send"
    assert_aborted(stopped, x_prompt, 24)
    assert stopped.finished.error is None  # a client's cancel, not a failure
    for rid, handle in handles.items():
        assert_exact(await collect(handle.events), *cases[rid])
    await assert_clean(c)
    return stopped


def disaggregated(**settings):
    return cluster(
        worker_info("p0", "prefill"), worker_info("d0", "decode"), max_num_batched_tokens=16,
        **settings,
    )  # fmt: skip


@pytest.mark.parametrize("streaming", [True, False])
def test_cancel_while_a_prompt_chunk_is_sent(streaming):
    async def scenario():
        async with disaggregated(kv_transfer_streaming=streaming) as c:
            stopped = await neighbours_and_victim(
                c, "p0", lambda item: not item.samples and item.num_computed_before > 0
            )
            assert stopped.tokens == []

    run(scenario())


def test_cancel_while_a_prompts_last_chunk_is_sent():
    async def scenario():
        async with disaggregated() as c:
            stopped = await neighbours_and_victim(c, "p0", lambda item: item.samples)
            assert stopped.tokens == []  # the token that step samples is dropped

    run(scenario())


@pytest.mark.parametrize("role", ["decode", "both"])
def test_cancel_while_a_decode_step_is_sent(role):
    async def scenario():
        infos = (
            [worker_info("w0", "both")]
            if role == "both"
            else [worker_info("p0", "prefill"), worker_info("w0", "decode")]
        )
        async with cluster(*infos, max_num_batched_tokens=16) as c:
            stopped = await neighbours_and_victim(
                c, "w0", lambda item: len(item.request.output_token_ids) >= 3
            )
            assert 3 <= len(stopped.tokens) < 24

    run(scenario())


@pytest.mark.parametrize("role", ["decode", "both"])
def test_cancel_while_a_beam_step_is_sent(role):
    async def scenario():
        infos = (
            [worker_info("w0", "both")]
            if role == "both"
            else [worker_info("p0", "prefill"), worker_info("w0", "decode")]
        )
        async with cluster(*infos, max_num_batched_tokens=32) as c:
            # The victim's second beam step (beams `x#2.*`) is being sent when it is cancelled.
            searches = {}
            hits = cancel_during_send(
                c, "w0", "x", lambda item: "#2." in item.request.request_id,
                abort=lambda: searches["x"].abort(),
            )  # fmt: skip
            beams = start_search(c, "b", prompt(7, 12), 3, 2, 10)
            greedy = submit(c, "g", prompt(8, 9), 16)
            victim = searches["x"] = start_search(c, "x", prompt(9, 14), 3, 2, 10)
            ended = await collect(victim.events, 2)
            assert hits, "the cancel was injected during a beam step's send"
            for stream in ended.values():
                assert stream.finished.reason is FinishReason.ABORT
                assert stream.finished.error is None
            results = await collect(beams.events, 2)
            assert [results[i].tokens for i in range(2)] == reference(prompt(7, 12), 3, 2, 10)
            assert_exact(await collect(greedy.events), prompt(8, 9), 16)
            await assert_clean(c)

    run(scenario())


def test_cancel_storm_at_random_sends():
    """Forty requests (greedy, n=2 samples, beam searches) over a prefill and two decode
    workers; at each send a seeded coin picks whether to cancel a live request (one the
    plan carries when there is one). Every cancelled sample ends ABORT without an error
    after a prefix of its tokens, every other one is exact, and the pools end empty and
    sound."""

    async def scenario():
        async with cluster(
            worker_info("p0", "prefill", num_blocks=48),
            worker_info("d0", "decode", num_blocks=40),
            worker_info("d1", "decode", num_blocks=40),
            max_num_batched_tokens=24,
        ) as c:
            rng = random.Random(40)
            samples: dict[str, list[str]] = {}  # client request -> its sample ids
            searches = {}  # client request -> its beam search
            cancelled: set[str] = set()  # samples whose abort found them running

            async def hook(plan) -> None:
                if rng.random() > 0.3:
                    return
                carried = {s.request.request_id.split("#")[0] for s in plan.scheduled}
                running = sorted(r for r, ids in samples.items() if set(ids) - cancelled)
                choice = sorted(r for r in running if carried & set(samples[r])) or running
                if not choice:
                    return
                rid = rng.choice(choice)
                if rid in searches:
                    if not searches[rid].done:
                        searches[rid].abort()
                        cancelled.add(rid)
                else:
                    for sample in samples[rid]:
                        if c.engine.abort(sample):
                            cancelled.add(sample)
                await asyncio.sleep(0)

            for w in c.workers:
                w.during_send = hook
            cases = []
            for i in range(40):
                kind, p = ("greedy", "greedy", "n", "beam")[i % 4], prompt(20 + i, 4 + (i * 7) % 37)
                rid, max_tokens = f"{kind}{i}", 10 + i % 13
                if kind == "beam":
                    handle = searches[rid] = start_search(c, rid, p, 2, 1, 8)
                    samples[rid] = [rid]
                elif kind == "n":
                    handle = c.engine.submit(n_samples(rid, p, max_tokens))[0]
                    samples[rid] = [f"{rid}/0", f"{rid}/1"]
                else:
                    handle = submit(c, rid, p, max_tokens)
                    samples[rid] = [rid]
                cases.append((rid, kind, p, max_tokens, handle))
                await asyncio.sleep(0)
            for rid, kind, p, max_tokens, handle in cases:
                got = await collect(handle.events, len(samples[rid]), timeout_s=20)
                streams = got if isinstance(got, dict) else {0: got}
                for index, stream in streams.items():
                    assert stream.finished.error is None, (rid, stream.finished.error)
                    if samples[rid][index] in cancelled:
                        assert_aborted(stream, p, max_tokens)
                    elif kind == "beam":
                        assert [stream.tokens] == reference(p, 2, 1, 8), rid
                    else:
                        assert_exact(stream, p, max_tokens)
            assert len(cancelled) >= 8, cancelled  # seeded: the same every run
            await assert_clean(c)

    run(scenario(), timeout_s=25)


def n_samples(rid: str, p: list[int], max_tokens: int) -> list[Request]:
    """Two samples of one prompt (greedy: the same tokens), as the servicer makes them."""
    out = [Request(f"{rid}/{i}", list(p), max_tokens, index=i) for i in range(2)]
    out[1].prompt_of = out[0].request_id
    return out


# -- a bug in one request's bookkeeping fails that request alone ---------------------------
class BrokenRequest(Request):
    """A request whose bookkeeping breaks at its third token (stands in for a bug)."""

    def append_token(self, token_id: int):
        if len(self.output_token_ids) == 2:
            raise RuntimeError("bookkeeping bug")
        return super().append_token(token_id)


class BrokenSink(asyncio.Queue):
    """An event sink that fails on the request's second Tokens event."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens_seen = 0

    def put_nowait(self, event) -> None:
        if isinstance(event, Tokens):
            self.tokens_seen += 1
            if self.tokens_seen == 2:
                raise RuntimeError("sink bug")
        super().put_nowait(event)


@pytest.mark.parametrize("where", ["update", "routing"])
@pytest.mark.parametrize("roles", [("both",), ("prefill", "decode")])
def test_a_bug_in_one_requests_bookkeeping_fails_only_that_request(where, roles):
    async def scenario():
        infos = [worker_info(f"w{i}", role) for i, role in enumerate(roles)]
        async with cluster(*infos, max_num_batched_tokens=16) as c:
            cases = {f"y{i}": (prompt(30 + i, 5 + 4 * i), 14) for i in range(4)}
            handles = {rid: submit(c, rid, p, n) for rid, (p, n) in cases.items()}
            bad_prompt = prompt(40, 9)
            if where == "update":
                (bad,) = c.engine.submit([BrokenRequest("bad", bad_prompt, 14)])
            else:
                (bad,) = c.engine.submit([Request("bad", bad_prompt, 14)], events=BrokenSink())
            failed = await collect(bad.events)
            assert failed.finished.reason is FinishReason.ABORT
            assert failed.finished.error[0] == "INTERNAL"
            assert "bug" in failed.finished.error[1]
            for rid, handle in handles.items():
                assert_exact(await collect(handle.events), *cases[rid])
            await assert_clean(c)

    run(scenario())


def test_a_submit_that_fails_unexpectedly_is_refused_alone():
    """The scheduler's session servicer: a bug met while admitting one request (here its
    pool's queue refuses the second sample, after the first was queued) refuses that
    request with INTERNAL and takes back what it started; the session and a request
    after it go on."""

    async def scenario():
        async with cluster(worker_info("w0"), max_num_batched_tokens=16) as c:
            scheduler = c.pool("w0").scheduler
            add = scheduler.add

            def broken_add(request, front=False):
                if request.request_id == "bad/1":
                    raise RuntimeError("queue bug")
                add(request, front)

            scheduler.add = broken_add
            state, servicer = SessionState(), SchedulerServicer()
            for rid, n in (("bad", 2), ("good", 1)):
                request = scheduler_pb2.SubmitRequest(
                    request_id=rid, prompt_token_ids=prompt(5, 7), max_tokens=6, n=n
                )
                servicer._submit(c.engine, request, state)
            events = []
            async with asyncio.timeout(5):
                while not any(isinstance(e, Finished) for r, e in events if r == "good"):
                    events.append(await state.queue.get())
            refusals = [e for r, e in events if r == "bad"]
            assert len(refusals) == 1 and refusals[0].code == "INTERNAL", refusals
            assert "queue bug" in refusals[0].message
            good = [
                t for r, e in events if r == "good" and isinstance(e, Tokens) for t in e.token_ids
            ]
            assert good == expected_tokens(prompt(5, 7), 6)
            await assert_clean(c)

    run(scenario())
