"""Prompt KV pulled from a same-host prefill worker's shared pool, started when the
prompt's last chunk is scheduled (streamed), in-process against fake workers: exact
streams, no UCX send, the transfer under way while the prompt still runs, and every way
it can end early (the first token finishes the request, an abort, a failed stream, a
worker killed mid-stream) leaves nothing behind."""

from __future__ import annotations

import asyncio

import pytest

from services.scheduler.handle import Stage
from tests.engine_cluster import (
    assert_aborted,
    assert_clean,
    assert_exact,
    cluster,
    collect,
    prompt,
    run,
    submit,
    until,
)
from tests.fake_model import expected_tokens
from tests.fake_worker import worker_info

pytestmark = pytest.mark.timeout(30)


def shared(worker_id: str, role: str):
    return worker_info(worker_id, role, shared_memory=True)


@pytest.mark.parametrize("streaming", [True, False])
def test_same_host_handoffs_pull_from_the_prefill_pool_and_stream_exact_tokens(streaming):
    async def scenario():
        async with cluster(
            shared("p0", "prefill"),
            shared("d0", "decode"),
            max_num_batched_tokens=8,  # long prompts come in chunks
            kv_transfer_streaming=streaming,
        ) as c:
            p0, d0 = c.worker("p0"), c.worker("d0")
            p0.step_delay_s = 0.02
            cases = [(prompt(i, length), 4 + i) for i, length in enumerate([1, 5, 8, 13, 21])]
            handles = [submit(c, f"r{i}", p, n) for i, (p, n) in enumerate(cases)]
            seen_stages = set()

            async def watch():
                while True:
                    if d0.receives_in_progress:
                        seen_stages.update(h.stage for h in handles if h.transfer is not None)
                    await asyncio.sleep(0.001)

            watcher = asyncio.create_task(watch())
            streams = await asyncio.gather(*(collect(h.events) for h in handles))
            watcher.cancel()
            for stream, (p, n) in zip(streams, cases, strict=True):
                assert_exact(stream, p, n)
            assert p0.send_tags == []  # nothing over UCX
            assert d0.pull_tags == d0.receive_tags and d0.receive_tags
            assert c.pool("d0").counters.kv_blocks_received == d0.kv_blocks_received
            # Streamed: receives under way while the prompt's step still ran.
            assert (Stage.PREFILL in seen_stages) is streaming
            await assert_clean(c)

    run(scenario())


def test_chunked_prompts_stream_each_chunks_finished_blocks_as_it_completes():
    async def scenario():
        async with cluster(
            shared("p0", "prefill"),
            shared("d0", "decode"),
            max_num_batched_tokens=6,  # chunks of 6 tokens end inside 4-token blocks
        ) as c:
            p0, d0 = c.worker("p0"), c.worker("d0")
            p0.step_delay_s = 0.02
            cases = [(prompt(20 + i, length), 5) for i, length in enumerate([29, 40, 7])]
            handles = [submit(c, f"r{i}", p, n) for i, (p, n) in enumerate(cases)]
            early: set[str] = set()  # received blocks before their last chunk was planned
            tags: dict[str, int] = {}

            async def watch():
                while True:
                    for h in handles:
                        t, r = h.transfer, h.request
                        if t is not None:
                            tags[r.request_id] = t.tag
                        if t is not None and r.num_computed_tokens < len(r.prompt_token_ids):
                            if d0.kv.get(t.dst_blocks[0]) is not None:
                                early.add(r.request_id)
                    await asyncio.sleep(0.001)

            watcher = asyncio.create_task(watch())
            streams = await asyncio.gather(*(collect(h.events) for h in handles))
            watcher.cancel()
            for stream, (p, n) in zip(streams, cases, strict=True):
                assert_exact(stream, p, n)  # no block copied before its last writer ran
            assert p0.send_tags == []
            assert sorted(set(d0.pull_tags)) == sorted(tags.values())
            # One pull per chunk that completes a block (the last always counts): the
            # 6-token budget is shared, so a 29-token prompt completes blocks in at least
            # 4 chunks, a 40-token one in at least 5.
            pulls = {rid: d0.pull_tags.count(tag) for rid, tag in tags.items()}
            assert pulls["r0"] >= 4 and pulls["r1"] >= 5, pulls
            assert early >= {"r0", "r1"}
            assert c.pool("d0").counters.kv_transfers == 3
            assert c.pool("d0").counters.kv_blocks_received == 8 + 10 + 2
            await assert_clean(c)

    run(scenario())


@pytest.mark.parametrize("chunk", [8, 64], ids=["chunked", "one-step"])
def test_prompts_of_whole_blocks_stream_without_a_failed_part(chunk):
    """A prompt that fills its last block exactly: the decode side allocates the prompt's
    blocks, not one more for the token its last step samples (that mismatch failed every
    such stream and fell back to the hand-off)."""

    async def scenario():
        async with cluster(
            shared("p0", "prefill"), shared("d0", "decode"), max_num_batched_tokens=chunk
        ) as c:
            c.worker("p0").step_delay_s = 0.01
            cases = [(prompt(40 + i, length), 4) for i, length in enumerate([4, 8, 16, 24])]
            handles = [submit(c, f"r{i}", p, n) for i, (p, n) in enumerate(cases)]
            streams = await asyncio.gather(*(collect(h.events) for h in handles))
            for stream, (p, n) in zip(streams, cases, strict=True):
                assert_exact(stream, p, n)
            d0 = c.worker("d0")
            assert len(set(d0.receive_tags)) == len(cases)  # one transfer each, no retry
            assert c.pool("d0").counters.kv_blocks_received == 1 + 2 + 4 + 6
            await assert_clean(c)

    run(scenario())


def test_a_request_of_one_token_is_not_streamed():
    async def scenario():
        async with cluster(shared("p0", "prefill"), shared("d0", "decode")) as c:
            p0, d0 = c.worker("p0"), c.worker("d0")
            p0.step_delay_s = 0.05
            p = prompt(2, 9)
            assert_exact(await collect(submit(c, "one", p, 1).events), p, 1)
            assert d0.receive_tags == []  # max_tokens=1: no decode step would use its KV
            assert_exact(await collect(submit(c, "two", p, 2).events), p, 2)
            assert len(d0.receive_tags) == 1
            await assert_clean(c)

    run(scenario())


def test_a_first_token_that_ends_the_request_cancels_its_streamed_transfer():
    async def scenario():
        async with cluster(shared("p0", "prefill"), shared("d0", "decode")) as c:
            p0, d0 = c.worker("p0"), c.worker("d0")
            p0.step_delay_s = 0.05
            p = prompt(2, 9)
            stop = expected_tokens(p, 1)  # its first token is a stop token
            stream = await collect(submit(c, "one", p, 8, stop=stop).events)
            assert_exact(stream, p, 8, stop=stop)
            assert stream.tokens == stop
            (tag,) = d0.receive_tags  # it was streaming when the first token ended it
            # The next request's step tells the decode worker the dead tag.
            assert_exact(await collect(submit(c, "b", prompt(3, 5), 4).events), prompt(3, 5), 4)
            assert tag in d0.cancelled_tags_received
            await until(lambda: not d0.receives_in_progress)
            await assert_clean(c)

    run(scenario())


def test_abort_while_the_prompt_runs_ends_its_stream():
    async def scenario():
        async with cluster(shared("p0", "prefill"), shared("d0", "decode")) as c:
            p0, d0 = c.worker("p0"), c.worker("d0")
            p0.hold_steps()
            p = prompt(4, 10)
            handle = submit(c, "a", p, 5)
            await until(lambda: bool(d0.receives_in_progress), what="the stream started")
            assert handle.stage is Stage.PREFILL
            assert c.engine.abort("a")
            assert_aborted(await collect(handle.events), p, 5)
            p0.release_steps()
            assert_exact(await collect(submit(c, "b", prompt(5, 6), 5).events), prompt(5, 6), 5)
            await until(lambda: not d0.receives_in_progress)
            await assert_clean(c)

    run(scenario())


def test_a_failed_stream_falls_back_to_the_handoff_after_the_prompt():
    async def scenario():
        async with cluster(shared("p0", "prefill"), shared("d0", "decode")) as c:
            p0, d0 = c.worker("p0"), c.worker("d0")
            p0.hold_steps()
            d0.fail_transfers()
            p = prompt(6, 11)
            handle = submit(c, "a", p, 6)
            await until(lambda: len(d0.receive_tags) == 1, what="the stream started")
            await until(lambda: handle.transfer is None, what="the stream failed")
            d0.heal_transfers()
            p0.release_steps()
            assert_exact(await collect(handle.events), p, 6)
            assert len(d0.receive_tags) == 2  # the stream, then the hand-off's pull
            assert c.engine.num_restarted_requests == 0
            await assert_clean(c)

    run(scenario())


@pytest.mark.parametrize("victim", ["prefill", "decode"])
def test_a_worker_killed_mid_stream_restarts_the_request_elsewhere(victim):
    async def scenario():
        async with cluster(
            shared("p0", "prefill"),
            shared("p1", "prefill"),
            shared("d0", "decode"),
            shared("d1", "decode"),
        ) as c:
            for w in c.workers:
                w.hold_steps()
            p = prompt(8, 10)
            handle = submit(c, "a", p, 6)
            await until(lambda: handle.transfer is not None, what="the stream started")
            transfer = handle.transfer
            dead = transfer.src if victim == "prefill" else transfer.dst
            c.worker(dead.info.worker_id).kill()
            for w in c.workers:
                w.release_steps()
            assert_exact(await collect(handle.events), p, 6)
            assert c.engine.num_worker_failures == 1
            if victim == "prefill":  # its KV is gone: the prompt is computed again
                assert c.engine.num_restarted_requests == 1
            else:
                # Whichever the engine notices first: the failed stream (the decode side
                # is dropped while the prompt still runs, and the finished prompt is handed
                # to the other decode worker: no restart) or the dead worker (restart).
                assert c.engine.num_restarted_requests in (0, 1)
            await assert_clean(c)

    run(scenario())


def test_a_receiver_that_cannot_map_the_pool_gets_kv_over_ucx_from_then_on():
    async def scenario():
        async with cluster(shared("p0", "prefill"), shared("d0", "decode")) as c:
            p0, d0 = c.worker("p0"), c.worker("d0")
            d0.refuse_pulls = True
            cases = [(prompt(i, 9 + i), 5) for i in range(3)]
            for i, (p, n) in enumerate(cases):  # one at a time: the first learns it
                assert_exact(await collect(submit(c, f"r{i}", p, n).events), p, n)
            assert len(d0.pull_tags) == 1  # refused once
            assert c.engine.num_restarted_requests == 1  # that request recomputed
            assert p0.send_tags and set(p0.send_tags) <= set(d0.receive_tags)  # then UCX
            await assert_clean(c)

    run(scenario())
