"""Beam search through the real Engine over fake workers (tests/fake_worker.py: its KV
holds each token written, every read is checked, and its logprobs are a pure function of
the sequence): each search returns what the policy returns when driven straight by the
fake model, on a `both` worker and prefill -> decode, beside greedy requests, and when
beams are preempted by recompute or swapped out (the search starts over); no KV error,
every block free and the invariants sound after."""

from __future__ import annotations

import asyncio

import pytest

from common.pb.tandem.internal.v1 import scheduler_pb2
from services.scheduler.beam_driver import BeamDriver
from services.scheduler.beam_search import BeamParams, BeamSearch
from services.scheduler.server import beam_template_from_pb
from tests.engine_cluster import cluster, collect, prompt, run, submit, until
from tests.fake_model import fake_top
from tests.fake_worker import worker_info

EOS = 11


def beam_submit(rid: str, prompt_ids, k: int, n: int, max_tokens: int, early="false"):
    request = scheduler_pb2.SubmitRequest(
        request_id=rid, prompt_token_ids=prompt_ids, max_tokens=max_tokens, n=n,
        stop_token_ids=[EOS],
    )  # fmt: skip
    request.beam_search.beam_width = k
    request.beam_search.length_penalty = 1.0
    request.beam_search.early_stopping = early
    return request


def reference(prompt_ids, k: int, n: int, max_tokens: int, early=False):
    params = BeamParams(
        beam_width=k,
        eos_token_ids=(EOS,),
        max_new_tokens=max_tokens,
        num_return_sequences=n,
        prompt_len=len(prompt_ids),
        early_stopping=early,
    )
    search = BeamSearch(params)
    while not search.is_done():
        need = search.candidates_needed()
        search.step([fake_top(list(prompt_ids) + list(b.tokens), need) for b in search.live_beams])
    return [list(h.tokens) for h in search.results()]


async def scenario(infos, searches, greedy=2, **settings):
    async with cluster(*infos, **settings) as c:
        finished = []  # the metrics hook: each search and each greedy request once
        c.engine.on_finish = lambda request, now: finished.append(request.request_id)
        drivers = []
        for i, (k, n, max_tokens) in enumerate(searches):
            template, params = beam_template_from_pb(
                beam_submit(f"b{i}", prompt(i, 20 + i), k, n, max_tokens), 512
            )
            driver = BeamDriver(c.engine, template, params, asyncio.Queue())
            driver.start()
            drivers.append((driver, n))
        plain = [submit(c, f"g{i}", prompt(50 + i, 30), 24) for i in range(greedy)]
        results = [await collect(d.events, n, timeout_s=20) for d, n in drivers]
        for handle in plain:
            await collect(handle.events, timeout_s=20)
        await asyncio.sleep(0.05)
        for _ in range(100):  # the last drops reach the workers
            if all(w.is_idle for w in c.workers):
                break
            await asyncio.sleep(0.02)
        errors = [e for w in c.workers for e in w.kv_errors]
        assert not errors, errors[:3]
        assert not c.engine.check_integrity()
        assert all(p.blocks.num_free_blocks == p.blocks.num_blocks for p in c.engine.pools)
        want = [f"b{i}" for i in range(len(searches))] + [f"g{i}" for i in range(greedy)]
        assert sorted(finished) == sorted(want)
        assert not c.engine.num_requests  # every beam's request released
        return results, sum(d.num_restarts for d, _ in drivers)


def check(results, searches):
    for i, ((k, n, max_tokens), got) in enumerate(zip(searches, results, strict=True)):
        streams = got if n > 1 else {0: got}
        want = reference(prompt(i, 20 + i), k, n, max_tokens)
        assert [streams[j].tokens for j in range(n)] == want, i


SEARCHES = [(2, 1, 12), (4, 2, 10), (8, 3, 8)]


@pytest.mark.parametrize("topology", ["both", "split"])
def test_beam_searches_equal_the_policy_on_the_fake_model(topology):
    if topology == "both":
        infos = [worker_info("w0", "both", num_blocks=256)]
    else:
        infos = [
            worker_info("p0", "prefill", num_blocks=256),
            worker_info("d0", "decode", num_blocks=256),
        ]
    results, _ = run(scenario(infos, SEARCHES), timeout_s=30)
    check(results, SEARCHES)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_lost_beams_restart_their_search_and_stay_exact(mode):
    """A pool too small for everything at once: beams are preempted (or swapped out) and
    their searches start over; the results are still the policy's."""
    infos = [worker_info("w0", "both", num_blocks=24, num_swap_blocks=64)]
    searches = [(4, 2, 10), (4, 1, 10)]
    results, restarts = run(
        scenario(infos, searches, greedy=2, preemption_mode=mode, max_num_batched_tokens=32),
        timeout_s=30,
    )
    check(results, searches)
    assert restarts > 0


def test_a_search_whose_decode_worker_dies_starts_over_and_stays_exact():
    """Its beams' KV (running and parked) dies with d0: each beam request ends ABORTED
    (`Request.restartable` is off), the driver releases the rest and submits the prompt
    again, and the search finishes on d1 with the policy's results."""

    async def scenario():
        async with cluster(
            worker_info("p0", "prefill", num_blocks=128),
            worker_info("d0", "decode", num_blocks=128),
            worker_info("d1", "decode", num_blocks=128),
        ) as c:
            d0 = c.worker("d0")
            d0.step_delay_s = 0.002
            template, params = beam_template_from_pb(beam_submit("b", prompt(3, 21), 4, 2, 12), 512)
            search = BeamDriver(c.engine, template, params, asyncio.Queue())
            search.start()
            # the search has forked beams on d0 (its second step's requests run there)
            await until(lambda: any("#2." in r for r in d0.planned_request_ids), timeout_s=5)
            d0.kill()
            results = await collect(search.events, 2, timeout_s=20)
            assert search.num_restarts >= 1
            assert [results[i].tokens for i in range(2)] == reference(prompt(3, 21), 4, 2, 12)
            assert c.engine.num_worker_failures == 1 and not c.engine.num_requests
            for pool in c.engine.pools:
                if pool.healthy:
                    assert pool.blocks.num_free_blocks == pool.blocks.num_blocks

    run(scenario(), timeout_s=30)
