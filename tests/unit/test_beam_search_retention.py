"""Retention hints on a beam search (issue 45, `kv_retention_s`) through the real Engine over
fake workers (tests/fake_worker.py: every KV read is checked): when the search finishes,
the blocks of its prompt and of its returned hypotheses are retained where its beams ran,
the blocks that only pruned beams held are not; a flood of other requests then evicts
everything unretained, and a request continuing the best hypothesis is served from the
retained blocks (the pool's prefix-hit counter; split prefill -> decode, the prompt's
blocks from the prefill pool and the hypothesis's at the hand-off) with the fake model's
exact tokens. A search without retention retains nothing. No block leaks."""

from __future__ import annotations

import asyncio
import time

import pytest

from common.prefix_hash import root_hash
from common.retention import RetentionLimits
from services.scheduler.admission import InvalidRequestError
from services.scheduler.beam_driver import BeamDriver
from services.scheduler.request import Request
from services.scheduler.server import beam_template_from_pb
from tests.engine_cluster import assert_clean, assert_exact, cluster, collect, prompt, run, until
from tests.fake_worker import worker_info
from tests.unit.test_beam_search_inprocess import beam_submit, reference

BLOCK = 4
PROMPT = prompt(1, 14)  # 3 full blocks and 2 tokens
K, N, MAX_NEW = 4, 2, 10


def cached_blocks(pool) -> set[int]:
    return {b.block_id for b in pool.blocks.pool.blocks if b.block_hash is not None}


def retained_blocks(pool) -> set[int]:
    return {b for b in cached_blocks(pool) if pool.blocks.pool.retained_until(b) > time.time()}


def chain(c, pool, prompt_ids: list[int], output: list[int], computed: int) -> set[int]:
    """The pool's cached blocks holding the first `computed` tokens of a prompt and its
    output (the hash root as `Engine.submit` makes it)."""
    rope = c.engine.pools[0].info.model.prompt_rope_key(len(prompt_ids))
    sequence = Request("probe", list(prompt_ids), 1, output_token_ids=list(output))
    sequence.hash_root = root_hash(c.engine.deployment_salt, "", "", rope)
    hashes = sequence.update_block_hashes(BLOCK)
    return set(pool.blocks.cached_prefix(hashes, sequence.all_token_ids, computed))


async def search(c, retention: float) -> list[list[int]]:
    submit = beam_submit("b", PROMPT, K, N, MAX_NEW)
    submit.kv_retention_s = retention
    template, params = beam_template_from_pb(submit, 512, c.engine.retention)
    driver = BeamDriver(c.engine, template, params, asyncio.Queue())
    driver.start()
    streams = await collect(driver.events, N, timeout_s=20)
    assert driver.num_restarts == 0
    await until(lambda: not c.engine.num_requests, what="every beam released")
    return [streams[i].tokens for i in range(N)]


async def plain(c, rid: str, prompt_ids: list[int], max_tokens: int):
    (handle,) = c.engine.submit([Request(rid, list(prompt_ids), max_tokens)])
    stream = await collect(handle.events, timeout_s=10)
    assert_exact(stream, prompt_ids, max_tokens)
    return stream


@pytest.mark.parametrize("topology", ["both", "split"])
def test_a_retained_search_keeps_its_prompt_and_hypotheses_past_a_flood(topology):
    async def scenario():
        if topology == "both":
            infos = [worker_info("w0", "both", num_blocks=48, block_size=BLOCK)]
        else:
            infos = [
                worker_info("p0", "prefill", num_blocks=48, block_size=BLOCK),
                worker_info("d0", "decode", num_blocks=48, block_size=BLOCK),
            ]
        async with cluster(*infos) as c:
            beams = c.engine.pools[-1]  # where the beams run and park
            hypotheses = await search(c, retention=600.0)
            assert hypotheses == reference(PROMPT, K, N, MAX_NEW)
            # A hypothesis's last token was chosen, never computed.
            kept = set().union(
                *(chain(c, beams, PROMPT, h, len(PROMPT) + len(h) - 1) for h in hypotheses)
            )
            assert len(kept) > 3  # the prompt's 3 blocks and the hypotheses' own
            assert retained_blocks(beams) == kept
            assert cached_blocks(beams) - kept  # pruned beams' full blocks: not retained
            if topology == "split":  # the prompt's blocks, kept at its hand-off
                prefill = c.engine.pools[0]
                assert retained_blocks(prefill) == chain(c, prefill, PROMPT, [], len(PROMPT))
            other = prompt(7, 12)  # an unretained conversation
            await plain(c, "other", other, 2)
            for i in range(6):  # 6 x 10 blocks in each pool: every unretained one goes
                await plain(c, f"flood{i}", prompt(20 + i, 39), 2)
            for pool in c.engine.pools:
                assert not chain(c, pool, other, [], len(other)) & cached_blocks(pool)
            assert retained_blocks(beams) == kept

            best = PROMPT + hypotheses[0]
            want = BLOCK * ((len(best) - 1) // BLOCK)  # its computed full blocks
            hits_before = [p.scheduler.num_prefix_hit_tokens for p in c.engine.pools]
            reused_before = beams.counters.kv_blocks_reused
            follow_up = best + [3, 1, 4]
            stream = await plain(c, "next", follow_up, 4)
            hits = [p.scheduler.num_prefix_hit_tokens - h
                    for p, h in zip(c.engine.pools, hits_before, strict=True)]  # fmt: skip
            if topology == "both":
                assert stream.first_cached_tokens == want and hits == [want]
            else:  # the prompt from the prefill pool; the rest at the hand-off
                assert stream.first_cached_tokens == 12 and hits == [12, 0]
                assert beams.counters.kv_blocks_reused - reused_before == want // BLOCK
            await assert_clean(c)

    run(scenario(), timeout_s=30)


def test_a_search_without_retention_retains_nothing():
    async def scenario():
        async with cluster(worker_info("w0", "both", num_blocks=48, block_size=BLOCK)) as c:
            assert await search(c, retention=0.0) == reference(PROMPT, K, N, MAX_NEW)
            assert retained_blocks(c.engine.pools[0]) == set()
            await assert_clean(c)

    run(scenario(), timeout_s=30)


def test_a_retention_over_the_limit_is_refused():
    submit = beam_submit("b", PROMPT, K, N, MAX_NEW)
    submit.kv_retention_s = 61.0
    with pytest.raises(InvalidRequestError, match="kv_retention_s must be <= 60"):
        beam_template_from_pb(submit, 512, RetentionLimits(60.0))
