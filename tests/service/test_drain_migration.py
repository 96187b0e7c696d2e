"""A decode worker told to drain (SIGTERM) hands the requests it holds to the other decode
worker with their KV, on a real stack (1 prefill + 2 decode workers, scheduler, gateway,
each its own process), whatever moves the KV between the workers; and again with decode
workers of two pipeline stages each (every stage's layers move from its own pool).

The requests go on where they land with nothing recomputed: every stream ends with
exactly HF's greedy tokens, no request starts over, no pool computes a prompt token
after the drain began, and the receiving pool got the KV blocks. The drained worker
exits cleanly while the requests it held are still generating elsewhere, and no block
is left held anywhere. With no decode worker left to take them (both drain), requests
run to the end where they are, as before moves existed.
"""

from __future__ import annotations

import signal
import time

import grpc
import pytest

from common.pb.tandem.internal.v1 import types_pb2
from services.stack.launcher import Stack
from tests.hf_reference import hf_greedy, hf_tokenizer
from tests.stack_client import (
    SAMPLE_PROMPTS,
    BackgroundStream,
    frozen,
    greedy_request,
    pool_stats,
    wait_until_idle,
)

# Six requests, two running per decode pool at a time: when the drain begins two run on
# each pool and two wait for room, so the drained worker holds some and more may reach it.
PROMPTS = SAMPLE_PROMPTS[:6]
# Long outputs: most requests still have hundreds of tokens to go when the drained worker
# has handed its requests on (the other worker is then frozen while it exits).
MAX_TOKENS = 320
MAX_NUM_SEQS = "2"
DECODE = types_pb2.WORKER_ROLE_DECODE
PREFILL = types_pb2.WORKER_ROLE_PREFILL


@pytest.fixture(scope="module", params=["one-process", "pp2"])
def stack(module_stacks, request):
    decode = ["--drain-timeout-s", "60"]
    if request.param == "pp2":
        decode += ["--pipeline-parallel-size", "2"]
    started = module_stacks(
        name=f"drain-migration-{request.param}",
        ready_timeout_s=240,
        prefill=1,
        decode=2,
        extra_args={
            "scheduler": [
                "--worker-health-interval-s",
                "0.25",
                "--worker-health-timeout-s",
                "0.5",
                "--worker-health-max-misses",  # the other worker's freeze is no failure
                "20",
                "--max-num-seqs",
                MAX_NUM_SEQS,
            ],
            "decode": decode,
        },
    )
    yield started
    started.stop()  # before the next layout's stack starts


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    tokenizer = hf_tokenizer(str(tiny_llama_dir))
    return {p: hf_greedy(tiny_llama_dir, tokenizer.encode(p), MAX_TOKENS) for p in PROMPTS}


def decode_names(stack: Stack) -> list[str]:
    return [p.name for p in stack.processes if p.name.startswith("decode-")]


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not true after {timeout_s}s"
        time.sleep(interval_s)


def by_worker(stats) -> dict[str, object]:
    return {p.worker_id: p for p in stats.pools}


def test_drained_decode_worker_hands_its_requests_over_with_their_kv(stack, reference):
    before = pool_stats(stack)
    streams = [
        BackgroundStream(stack.spec.gateway_address, greedy_request(p, MAX_TOKENS), 300)
        for p in PROMPTS
    ]
    for stream in streams:
        stream.wait_tokens(1)  # every prompt ran (the rest wait for room in a decode pool)
    deadline = time.monotonic() + 60
    while sum(len(s.token_ids) > 4 for s in streams) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)  # and the first ones are mid-generation
    held = by_worker(pool_stats(stack))
    draining = max(decode_names(stack), key=lambda n: held[n].num_requests)
    other = next(n for n in decode_names(stack) if n != draining)
    assert held[draining].num_requests > 0, "no request on either decode worker"

    at_sigterm = pool_stats(stack)
    moved_before = by_worker(at_sigterm)[draining].kv_migrations_out
    stack.signal(draining, signal.SIGTERM)
    sigterm_at = time.monotonic()

    def handed_on() -> bool:  # every request it held moved, KV and all: it holds nothing
        pool = by_worker(pool_stats(stack))[draining]
        moved = pool.kv_migrations_out >= moved_before + held[draining].num_requests
        return moved and pool.num_requests == 0 and pool.num_free_blocks == pool.num_blocks

    wait_for(handed_on, 60, "what it held moved", interval_s=0.005)
    # Then the other worker is frozen while the drained one exits: nothing can finish
    # meanwhile. Four requests or more still had 320 tokens to go at the drain, two at a
    # time there (640 steps and more), far more than the moment the poll above takes: the
    # drained worker surely leaves while what it held is still generating elsewhere.
    with frozen(stack, [other]):
        assert stack.wait_exit(draining, timeout_s=60) == 0
        exited_at = time.monotonic()
        tokens_at_exit = [len(s.token_ids) for s in streams]
        still_running = sum(s.code is None for s in streams)

    for prompt, stream in zip(PROMPTS, streams, strict=True):
        stream.result(timeout_s=300)
        assert stream.code == grpc.StatusCode.OK, (prompt, stream.code, stream.details)
        assert stream.token_ids == reference[prompt], prompt  # token for token, none lost
    ended_at = max(s.ended_at for s in streams)

    after = pool_stats(stack)
    pools, pools_then = by_worker(after), by_worker(at_sigterm)
    migrated = pools[draining].kv_migrations_out - pools_then[draining].kv_migrations_out
    assert migrated >= held[draining].num_requests  # what it held (and what reached it)
    assert pools[other].kv_blocks_received > pools_then[other].kv_blocks_received
    assert pools[other].kv_migrations_out == pools_then[other].kv_migrations_out
    # Nothing started over, and no pool computed a prompt token after the drain began:
    # the moved requests went on from their last token.
    assert after.restarted_requests == before.restarted_requests
    for name, pool in pools.items():
        assert pool.prompt_tokens_computed == pools_then[name].prompt_tokens_computed, name
    assert pools[other].prompt_tokens_computed == 0  # a decode pool never computes a prompt

    # The drained worker left while what it held was still generating elsewhere.
    exit_s, generation_s = exited_at - sigterm_at, ended_at - sigterm_at
    assert still_running > 0 and exit_s < generation_s, (exit_s, generation_s)
    tokens_after_exit = sum(len(s.token_ids) for s in streams) - sum(tokens_at_exit)
    assert tokens_after_exit > 0, (exit_s, generation_s)
    print(
        f"drain: {migrated} moved, worker exit {exit_s:.2f}s after SIGTERM, generation "
        f"{generation_s:.2f}s, {tokens_after_exit} tokens after the exit"
    )

    # The exit fails its pool (it rejoins when restarted).
    wait_for(lambda: not by_worker(pool_stats(stack))[draining].healthy, 10, "pool failed")
    assert pool_stats(stack).worker_failures == before.worker_failures + 1
    stats = wait_until_idle(stack, skip=(draining,))  # every block of every pool free
    assert not stats.integrity_errors


def test_with_no_decode_worker_accepting_requests_run_to_the_end_where_they_are(stack, reference):
    for name in decode_names(stack):  # the previous test's drained worker, back again
        if not stack.alive(stack.process(name)):
            stack.restart(name)
    wait_for(
        lambda: all(p.healthy and not p.draining for p in pool_stats(stack).pools),
        30,
        "every pool healthy",
    )
    before = pool_stats(stack)
    prompts, max_tokens = PROMPTS[:4], 160
    streams = [
        BackgroundStream(stack.spec.gateway_address, greedy_request(p, max_tokens), 300)
        for p in prompts
    ]
    for stream in streams:
        stream.wait_tokens(2)
    for name in decode_names(stack):  # both drain: neither can take the other's requests
        stack.signal(name, signal.SIGTERM)
    for prompt, stream in zip(prompts, streams, strict=True):
        stream.result(timeout_s=300)
        assert stream.code == grpc.StatusCode.OK, (prompt, stream.code, stream.details)
        assert stream.token_ids == reference[prompt][:max_tokens], prompt
    for name in decode_names(stack):
        assert stack.wait_exit(name, timeout_s=60) == 0, name
    after = pool_stats(stack)
    # A move may have begun before the second drain was seen; none is lost or redone.
    assert after.restarted_requests == before.restarted_requests
    for pool in after.pools:
        assert pool.num_free_blocks == pool.num_blocks and pool.num_requests == 0
    assert after.num_requests == 0
