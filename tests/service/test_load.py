"""Overload on a real stack whose KV pools hold a few requests at a time: many more
concurrent requests than fit, a bounded waiting queue, and a client that stops reading.

Every request either finishes with exactly HF's greedy tokens or is refused up front with
RESOURCE_EXHAUSTED; afterwards every pool is back at baseline with sound invariants.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from common.pb.tandem.v1 import generate_pb2_grpc
from tests.hf_reference import hf_greedy, hf_tokenizer
from tests.stack_client import (
    SAMPLE_PROMPTS,
    generate,
    greedy_request,
    pool_stats,
    wait_until_idle,
)

PROMPTS = SAMPLE_PROMPTS
MAX_TOKENS = 32
NUM_BLOCKS = 24  # 16-token blocks: about 6 requests' KV per pool
MAX_WAITING = 48


@pytest.fixture(scope="module")
def stack(module_stacks):
    return module_stacks(
        name="load",
        extra_args={
            "prefill": ["--num-blocks", str(NUM_BLOCKS), "--max-model-len", "256"],
            "decode": ["--num-blocks", str(NUM_BLOCKS), "--max-model-len", "256"],
            "scheduler": ["--max-waiting-requests", str(MAX_WAITING)],
        },
    )


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    tokenizer = hf_tokenizer(str(tiny_llama_dir))
    return {p: hf_greedy(tiny_llama_dir, tokenizer.encode(p), MAX_TOKENS) for p in PROMPTS}


async def fire(address: str, count: int) -> list[tuple[str, grpc.StatusCode, list[int], str]]:
    """`count` Generate calls at once; (prompt, status, token ids, details) for each."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)

        async def one(i: int):
            prompt = PROMPTS[i % len(PROMPTS)]
            ids = []
            try:
                async for response in stub.Generate(
                    greedy_request(prompt, MAX_TOKENS), timeout=300
                ):
                    ids.extend(response.token_ids)
            except grpc.aio.AioRpcError as exc:
                return prompt, exc.code(), ids, exc.details()
            return prompt, grpc.StatusCode.OK, ids, ""

        return await asyncio.gather(*(one(i) for i in range(count)))


def test_far_more_requests_than_the_pools_hold_finish_exactly_or_are_refused(stack, reference):
    before = pool_stats(stack)
    capacity = NUM_BLOCKS * 16 // (16 + MAX_TOKENS)  # requests whose KV fits in one pool
    count = 160
    started = time.monotonic()
    results = asyncio.run(fire(stack.spec.gateway_address, count))
    elapsed = time.monotonic() - started
    codes = [code for _, code, _, _ in results]
    finished = [r for r in results if r[1] == grpc.StatusCode.OK]
    refused = [r for r in results if r[1] == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert len(finished) + len(refused) == count, {c.name for c in codes}
    for prompt, _, ids, _ in finished:
        assert ids == reference[prompt], prompt
    for _, _, ids, details in refused:
        assert ids == [] and "max_waiting_requests" in details, details
    # The queue bound is what refused them, and the pools really overflowed.
    assert refused, "the waiting queue never filled"
    assert len(finished) >= MAX_WAITING  # at least a full queue was admitted and served
    after = wait_until_idle(stack, timeout_s=30)
    assert after.rejected_requests - before.rejected_requests == len(refused)
    preemptions = sum(p.preemptions for p in after.pools) - sum(p.preemptions for p in before.pools)
    print(
        f"load: {count} concurrent requests on pools of {NUM_BLOCKS} blocks (~{capacity} "
        f"requests each): {len(finished)} finished HF-exact, {len(refused)} refused "
        f"RESOURCE_EXHAUSTED, {preemptions} preemptions, {elapsed:.1f}s"
    )
    assert all(stack.alive(p) for p in stack.processes)


def test_a_client_that_stops_reading_holds_up_nobody(stack, reference):
    """A stream nobody reads for a while: the other requests finish meanwhile, and the
    slow one still gets exactly its tokens when it reads (it buffers at most max_tokens)."""
    with grpc.insecure_channel(stack.spec.gateway_address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        stalled = stub.Generate(greedy_request(PROMPTS[0], MAX_TOKENS), timeout=120)
        started = time.monotonic()
        for prompt in PROMPTS[1:4]:
            assert (
                generate(stack.spec.gateway_address, greedy_request(prompt, MAX_TOKENS)).token_ids
                == reference[prompt]
            )
        others_done = time.monotonic() - started
        time.sleep(1.0)
        ids = [t for response in stalled for t in response.token_ids]
    assert ids == reference[PROMPTS[0]]
    assert others_done < 30
    wait_until_idle(stack)
