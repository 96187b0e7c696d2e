"""Fault injection on a real disaggregated stack (2 prefill + 2 decode workers, scheduler,
gateway, each its own process): workers and services are SIGKILLed, frozen with SIGSTOP
(a hung peer: its UCX endpoint and gRPC port stay open but nothing answers) and SIGTERMed
mid-request.

After every scenario: each request either finished with exactly HF's greedy tokens or got
a clear status, the pools are back at baseline with sound invariants, and no process
exited except the one the test killed (which is then restarted and rejoins).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import grpc
import pytest

from common.healthcheck import health_status
from common.pb.tandem.internal.v1 import types_pb2
from common.pb.tandem.v1 import generate_pb2
from services.stack.launcher import Stack
from tests.fault_injection import (
    assert_all_alive,
    assert_all_alive_but,
    kill_busiest,
    names,
    pools_by_name,
    wait_for,
    wait_healthy_pools,
)
from tests.hf_reference import hf_greedy, hf_tokenizer
from tests.stack_client import (
    SAMPLE_PROMPTS,
    BackgroundStream,
    frozen,
    generate,
    greedy_request,
    pool_stats,
    wait_until_idle,
    worker_active_requests,
)

PROMPTS = SAMPLE_PROMPTS
LONG_OUTPUT = 96
# A frozen worker is declared failed after 4 missed health checks, each one interval plus
# one timeout: about 4 s here. Freezes shorter than that must not fail anyone.
HEALTH_FLAGS = [
    "--worker-health-interval-s",
    "0.5",
    "--worker-health-timeout-s",
    "0.5",
    "--worker-health-max-misses",
    "4",
]
DETECTION_BOUND_S = 4 * (0.5 + 0.5)
PREFILL = types_pb2.WORKER_ROLE_PREFILL


@pytest.fixture(scope="module")
def stack(module_stacks):
    return module_stacks(
        name="faults",
        ready_timeout_s=240,
        prefill=2,
        decode=2,
        extra_args={
            "scheduler": [*HEALTH_FLAGS, "--max-num-batched-tokens", "64"],
            "prefill": ["--kv-transfer-timeout-s", "10", "--drain-timeout-s", "20"],
            "decode": ["--kv-transfer-timeout-s", "10", "--drain-timeout-s", "20"],
        },
    )


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """HF greedy ids for every prompt, LONG_OUTPUT tokens (shorter runs are prefixes)."""
    tokenizer = hf_tokenizer(str(tiny_llama_dir))
    return {
        prompt: hf_greedy(tiny_llama_dir, tokenizer.encode(prompt), LONG_OUTPUT)
        for prompt in PROMPTS
    }


def start_streams(stack: Stack, max_tokens: int = LONG_OUTPUT, timeout: float = 120.0):
    return [
        BackgroundStream(stack.spec.gateway_address, greedy_request(p, max_tokens), timeout)
        for p in PROMPTS
    ]


def assert_exact(streams, reference) -> None:
    for prompt, stream in zip(PROMPTS, streams, strict=True):
        stream.result()
        assert stream.code == grpc.StatusCode.OK, (prompt, stream.code, stream.details)
        expected = reference[prompt][: len(stream.token_ids)]
        assert stream.token_ids == expected, prompt
        assert len(stream.token_ids) == len(reference[prompt]), prompt


def test_decode_worker_killed_mid_generation_requests_finish_exactly_elsewhere(stack, reference):
    before = pool_stats(stack)
    streams = start_streams(stack)
    for stream in streams:
        stream.wait_tokens(2)
    victim = kill_busiest(stack, "decode")
    assert_exact(streams, reference)  # no token lost, none repeated

    after = pool_stats(stack)
    assert after.worker_failures == before.worker_failures + 1
    assert after.restarted_requests > before.restarted_requests
    assert not pools_by_name(stack)[victim].healthy
    wait_until_idle(stack, skip=(victim,))
    assert_all_alive_but(stack, victim)

    # The last decode worker goes too: nothing can finish, so requests are refused.
    survivor = next(n for n in names(stack, "decode") if n != victim)
    stack.signal(survivor, signal.SIGKILL)
    stack.wait_exit(survivor)
    wait_for(
        lambda: health_status(stack.spec.scheduler_address) == "NOT_SERVING",
        DETECTION_BOUND_S + 5,
        "scheduler NOT_SERVING with no decode worker",
    )
    wait_for(  # the gateway mirrors the scheduler's health
        lambda: health_status(stack.spec.gateway_address) == "NOT_SERVING", 5, "gateway"
    )
    with pytest.raises(grpc.RpcError) as refused:
        generate(stack.spec.gateway_address, greedy_request(PROMPTS[0], 4), timeout=20)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "decode" in refused.value.details()

    # Restarted, both rejoin with empty pools and serve exactly again.
    stack.restart_all([victim, survivor])
    wait_healthy_pools(stack)
    completion = generate(stack.spec.gateway_address, greedy_request(PROMPTS[1], 24))
    assert completion.token_ids == reference[PROMPTS[1]][:24]
    wait_until_idle(stack)
    assert_all_alive(stack)


def test_prefill_worker_killed_mid_prompt_requests_recompute_on_the_other(stack, reference):
    wait_healthy_pools(stack)
    before = pool_stats(stack)
    # Long prompts in 64-token chunks keep both prefill workers busy for many steps.
    long_prompts = [" ".join([p] * 12) for p in PROMPTS]
    streams = [
        BackgroundStream(stack.spec.gateway_address, greedy_request(p, 8)) for p in long_prompts
    ]
    wait_for(
        lambda: sum(p.num_requests for p in pool_stats(stack).pools if p.role == PREFILL) >= 4,
        30,
        "prompts running on the prefill workers",
        interval_s=0.01,
    )
    victim = kill_busiest(stack, "prefill")
    tokenizer = hf_tokenizer(stack.spec.model)
    for prompt, stream in zip(long_prompts, streams, strict=True):
        stream.result()
        assert stream.code == grpc.StatusCode.OK, (stream.code, stream.details)
        assert stream.token_ids == hf_greedy(Path(stack.spec.model), tokenizer.encode(prompt), 8)
    assert pool_stats(stack).worker_failures == before.worker_failures + 1
    wait_until_idle(stack, skip=(victim,))
    assert_all_alive_but(stack, victim)
    stack.restart(victim)
    wait_healthy_pools(stack)


def test_cancel_and_deadline_release_a_transfer_to_a_frozen_decode_worker(stack):
    """With both decode workers frozen, a request's KV transfer hangs. A client cancel and
    an expired deadline must each release the prefill blocks and the decode reservation
    at once, without any answer from the frozen workers."""
    wait_healthy_pools(stack)
    decodes = names(stack, "decode")
    for name in decodes:
        stack.signal(name, signal.SIGSTOP)
    try:
        frozen_at = time.monotonic()
        cancelled = BackgroundStream(stack.spec.gateway_address, greedy_request(PROMPTS[2], 32))
        cancelled.wait_tokens(1)  # the prompt ran; its transfer to a frozen worker starts
        reserved = pools_by_name(stack)
        assert sum(reserved[n].num_requests for n in decodes) == 1  # the decode reservation
        cancelled.cancel()
        idle = wait_for(
            lambda: (
                (s := pool_stats(stack)).num_requests == 0
                and all(p.num_free_blocks == p.num_blocks for p in s.pools)
            ),
            1.0,
            "blocks released after the cancel",
        )
        assert idle
        expiring = BackgroundStream(
            stack.spec.gateway_address, greedy_request(PROMPTS[3], 32), timeout=0.6
        )
        expiring.result()
        assert expiring.code == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_for(
            lambda: (
                (s := pool_stats(stack)).num_requests == 0
                and all(p.num_free_blocks == p.num_blocks for p in s.pools)
            ),
            1.0,
            "blocks released after the deadline",
        )
        assert time.monotonic() - frozen_at < DETECTION_BOUND_S  # nobody was declared dead
    finally:
        for name in decodes:
            stack.signal(name, signal.SIGCONT)
    assert all(p.healthy for p in pool_stats(stack).pools)
    wait_until_idle(stack)
    assert_all_alive(stack)


def test_prefill_worker_killed_mid_transfer_releases_the_decode_reservations(stack, reference):
    """The sending side of a KV transfer dies with its prompts computed. Pulled through
    shared memory, the decode workers still copy the final KV out of the dead worker's
    pool (their mapping keeps it) and nothing recomputes; over UCX the failed SendKv ends
    the transfer at once and the requests recompute on the other prefill worker. Either
    way every request finishes exactly and the dead worker is failed within the health
    checks' bound."""
    wait_healthy_pools(stack)
    decodes, prefills = names(stack, "decode"), names(stack, "prefill")
    for name in decodes:  # transfers cannot complete while the receivers are frozen
        stack.signal(name, signal.SIGSTOP)
    try:
        streams = start_streams(stack, max_tokens=24)
        for stream in streams:
            stream.wait_tokens(1)  # every prompt ran; its transfer is under way
        pools = pools_by_name(stack)
        assert sum(pools[n].num_requests for n in decodes) == len(PROMPTS)
        victim = max(prefills, key=lambda n: pools[n].num_requests)
        assert pools[victim].num_requests > 0
        stack.signal(victim, signal.SIGKILL)
    finally:
        for name in decodes:
            stack.signal(name, signal.SIGCONT)
    stack.wait_exit(victim)
    for prompt, stream in zip(PROMPTS, streams, strict=True):
        stream.result()
        assert stream.code == grpc.StatusCode.OK, (stream.code, stream.details)
        assert stream.token_ids == reference[prompt][:24], prompt
    wait_for(lambda: not pools_by_name(stack)[victim].healthy, DETECTION_BOUND_S + 3, "failed")
    wait_until_idle(stack, skip=(victim,))
    assert_all_alive_but(stack, victim)
    stack.restart(victim)
    wait_healthy_pools(stack)


def test_frozen_decode_peer_mid_transfer_is_failed_and_its_requests_recomputed(stack, reference):
    """A UCX peer that stops answering mid-transfer: its reservations are released once
    the health checks give up on it (bounded), and the requests finish on the other."""
    wait_healthy_pools(stack)
    before = pool_stats(stack)
    frozen, other = names(stack, "decode")
    for name in (frozen, other):
        stack.signal(name, signal.SIGSTOP)
    try:
        streams = start_streams(stack, max_tokens=24)
        wait_for(
            lambda: pools_by_name(stack)[frozen].num_requests > 0,
            10,
            "a transfer to the frozen worker",
            interval_s=0.01,
        )
    finally:
        stack.signal(other, signal.SIGCONT)
    cut_at = time.monotonic()
    wait_for(lambda: not pools_by_name(stack)[frozen].healthy, DETECTION_BOUND_S + 3, "failed")
    released_after = time.monotonic() - cut_at
    assert pools_by_name(stack)[frozen].num_requests == 0
    assert released_after < DETECTION_BOUND_S + 3
    for prompt, stream in zip(PROMPTS, streams, strict=True):
        stream.result()
        assert stream.code == grpc.StatusCode.OK, (stream.code, stream.details)
        assert stream.token_ids == reference[prompt][:24], prompt
    assert pool_stats(stack).worker_failures == before.worker_failures + 1
    stack.signal(frozen, signal.SIGKILL)
    stack.wait_exit(frozen)
    wait_until_idle(stack, skip=(frozen,))
    assert_all_alive_but(stack, frozen)
    stack.restart(frozen)
    wait_healthy_pools(stack)


def test_scheduler_killed_mid_stream_gives_unavailable_and_workers_free_everything(
    stack, reference
):
    wait_healthy_pools(stack)
    streams = start_streams(stack)
    for stream in streams:
        stream.wait_tokens(2)
    stack.signal("scheduler", signal.SIGKILL)
    killed_at = time.monotonic()
    stack.wait_exit("scheduler")
    wait_for(
        lambda: health_status(stack.spec.gateway_address) == "NOT_SERVING", 5, "gateway health"
    )
    for stream in streams:
        stream.result(timeout_s=10)
        assert stream.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.OK), stream.code
        assert stream.ended_at - killed_at < 5
        # What arrived before the failure is still exactly HF's.
        prompt = PROMPTS[streams.index(stream)]
        assert stream.token_ids == reference[prompt][: len(stream.token_ids)]
    assert any(s.code == grpc.StatusCode.UNAVAILABLE for s in streams)
    wait_for(
        lambda: not any(worker_active_requests(stack).values()),
        5,
        "workers dropped the dead scheduler's requests",
    )
    with pytest.raises(grpc.RpcError) as refused:
        generate(stack.spec.gateway_address, greedy_request(PROMPTS[0], 4), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    stack.restart("scheduler")
    wait_for(lambda: health_status(stack.spec.gateway_address) == "SERVING", 30, "gateway SERVING")
    completion = generate(stack.spec.gateway_address, greedy_request(PROMPTS[4], 24))
    assert completion.token_ids == reference[PROMPTS[4]][:24]
    wait_until_idle(stack)
    assert_all_alive(stack)


def test_gateway_killed_mid_stream_aborts_its_requests_everywhere(stack, reference):
    wait_healthy_pools(stack)
    streams = start_streams(stack)
    for stream in streams:
        stream.wait_tokens(2)
    stack.signal("gateway", signal.SIGKILL)
    stack.wait_exit("gateway")
    for stream in streams:
        stream.result(timeout_s=10)
        assert stream.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.OK), stream.code
    wait_until_idle(stack)  # the scheduler aborted every orphaned request
    assert_all_alive_but(stack, "gateway")
    stack.restart("gateway")
    completion = generate(stack.spec.gateway_address, greedy_request(PROMPTS[5], 24))
    assert completion.token_ids == reference[PROMPTS[5]][:24]


def test_gateway_drains_on_sigterm(stack, reference):
    """SIGTERM: health NOT_SERVING, new requests UNAVAILABLE, the open stream finishes
    exactly, then a clean exit."""
    wait_healthy_pools(stack)
    stream = BackgroundStream(stack.spec.gateway_address, greedy_request(PROMPTS[6], 64))
    stream.wait_tokens(2)
    decodes = names(stack, "decode")
    for name in decodes:  # hold the stream open while the gateway drains
        stack.signal(name, signal.SIGSTOP)
    try:
        stack.signal("gateway", signal.SIGTERM)
        wait_for(lambda: health_status(stack.spec.gateway_address) == "NOT_SERVING", 2, "draining")
        with pytest.raises(grpc.RpcError) as refused:
            generate(stack.spec.gateway_address, greedy_request(PROMPTS[0], 4), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in refused.value.details()
    finally:
        for name in decodes:
            stack.signal(name, signal.SIGCONT)
    stream.result()
    assert stream.code == grpc.StatusCode.OK, (stream.code, stream.details)
    assert stream.token_ids == reference[PROMPTS[6]][:64]
    assert stack.wait_exit("gateway") == 0
    wait_until_idle(stack)
    stack.restart("gateway")
    assert_all_alive(stack)


def test_decode_worker_drains_on_sigterm_without_losing_a_request(stack, reference):
    """A SIGTERMed decode worker hands what it holds to the other decode worker with its
    KV, or finishes it (no request starts over either way: test_drain_migration.py), takes
    nothing new, exits cleanly, and rejoins when started again."""
    wait_healthy_pools(stack)
    before = pool_stats(stack)
    streams = start_streams(stack)
    for stream in streams:
        stream.wait_tokens(2)
    pools = pools_by_name(stack)
    draining = max(names(stack, "decode"), key=lambda n: pools[n].num_requests)
    stack.signal(draining, signal.SIGTERM)
    wait_for(lambda: pools_by_name(stack)[draining].draining, 5, "scheduler sees the drain")
    late = generate(stack.spec.gateway_address, greedy_request(PROMPTS[7], 24))
    assert late.token_ids == reference[PROMPTS[7]][:24]
    assert_exact(streams, reference)
    assert stack.wait_exit(draining) == 0
    after = pool_stats(stack)
    assert after.restarted_requests == before.restarted_requests  # nothing recomputed
    wait_until_idle(stack, skip=(draining,))
    stack.restart(draining)
    wait_healthy_pools(stack)
    assert_all_alive(stack)


def test_constrained_requests_survive_a_killed_decode_worker(stack, tiny_llama_dir):
    """Requests under a grammar lose their decode worker mid-generation: they are recomputed
    on the other one, whose matchers replay the tokens already sent, and every output still
    full-matches (no token lost or repeated)."""
    import re

    wait_healthy_pools(stack)
    before = pool_stats(stack)
    # No token of this byte-level BPE holds a space after its first character: each " x"
    # costs a token or two, so a request still has 44 steps or more to go after 3 tokens,
    # and the frozen victim (`kill_busiest`) surely holds some.
    regex = "[a-z]( [a-z]){45}[.]"
    requests = []
    for i, prompt in enumerate(PROMPTS[:4]):
        request = greedy_request(prompt, 120)
        request.sampling.temperature = 1.0
        request.sampling.seed = 5 + i
        request.structured_output.regex = regex
        requests.append(request)
    streams = [BackgroundStream(stack.spec.gateway_address, r, 120.0) for r in requests]
    for stream in streams:
        stream.wait_tokens(3)
    victim = kill_busiest(stack, "decode")
    tokenizer = hf_tokenizer(str(tiny_llama_dir))
    for stream in streams:
        stream.result()
        assert stream.code == grpc.StatusCode.OK, (stream.code, stream.details)
        assert stream.finish_reason == generate_pb2.FINISH_REASON_STOP, stream.finish_reason
        text = tokenizer.decode(stream.token_ids, skip_special_tokens=True)
        assert re.fullmatch(regex, text), text
    assert pool_stats(stack).restarted_requests > before.restarted_requests
    wait_until_idle(stack, skip=(victim,))
    stack.restart(victim)
    wait_healthy_pools(stack)
    assert_all_alive(stack)


BEAM_PROMPTS = ([5, 17, 300, 42], [9, 250, 3, 77, 101, 64])


def start_beam_searches(stack: Stack, pool):
    """Two k=4 searches (80 tokens, early_stopping never, the 2 best back), on `pool`."""
    from tests.service.test_e2e_beam_search import beam_request, run_beam

    futures = []
    for prompt in BEAM_PROMPTS:
        request = beam_request(prompt, 4, 1.0, "never", 2)
        request.max_tokens = 80
        futures.append(pool.submit(run_beam, stack.spec.gateway_address, request))
    return futures


def assert_hf_beams(model_dir, results) -> None:
    from tests.hf_reference import hf_beam_search, hf_model

    eos = [hf_model(str(model_dir)).generation_config.eos_token_id]
    for prompt, got in zip(BEAM_PROMPTS, results, strict=True):
        ref = hf_beam_search(model_dir, prompt, num_beams=4, max_new_tokens=80,
                             eos_token_ids=eos, num_return_sequences=2,
                             early_stopping="never")  # fmt: skip
        assert [got[i]["tokens"] for i in range(2)] == [h[0] for h in ref]


def test_beam_searches_survive_a_killed_decode_worker(stack, tiny_llama_dir):
    """Beam searches lose their decode worker mid-search: each starts over from its prompt
    (nothing was sent yet) on the other decode worker and still returns HF's hypotheses."""
    from concurrent.futures import ThreadPoolExecutor

    wait_healthy_pools(stack)
    before = pool_stats(stack)
    with ThreadPoolExecutor(len(BEAM_PROMPTS)) as pool:
        futures = start_beam_searches(stack, pool)
        wait_for(
            lambda: sum(p.num_requests for p in pool_stats(stack).pools if p.role != PREFILL) >= 4,
            30,
            "beams decoding",
            interval_s=0.01,
        )
        victim = kill_busiest(stack, "decode")
        results = [f.result() for f in futures]
    assert_hf_beams(tiny_llama_dir, results)
    after = pool_stats(stack)
    assert after.worker_failures == before.worker_failures + 1
    assert after.restarted_requests > before.restarted_requests
    wait_until_idle(stack, skip=(victim,))
    stack.restart(victim)
    wait_healthy_pools(stack)
    assert_all_alive(stack)


def test_beam_searches_move_on_with_their_kv_when_their_decode_worker_drains(stack, tiny_llama_dir):
    """A SIGTERMed decode worker hands on what it holds with its KV, beam searches' requests
    included (each beam is an ordinary request of its search's driver): the searches go on
    on the other decode worker with nothing started over, return HF's hypotheses, and the
    draining worker exits cleanly."""
    from concurrent.futures import ThreadPoolExecutor

    wait_healthy_pools(stack)
    before = pool_stats(stack)
    with ThreadPoolExecutor(len(BEAM_PROMPTS)) as pool:
        futures = start_beam_searches(stack, pool)
        wait_for(
            lambda: max(p.num_requests for p in pool_stats(stack).pools if p.role != PREFILL) >= 4,
            30,
            "beams decoding",
            interval_s=0.01,
        )
        # Frozen while told: the searches (80 steps each) are a few steps in, and the
        # scheduler learns of the drain from the next step result (`draining`), a step or
        # two later, not at its next health check: the victim surely holds beams then.
        with frozen(stack, names(stack, "decode")):
            pools = pools_by_name(stack)
            draining = max(names(stack, "decode"), key=lambda n: pools[n].num_requests)
            assert pools[draining].num_requests >= 4
            moved_before = pools[draining].kv_migrations_out
            stack.signal(draining, signal.SIGTERM)
        results = [f.result() for f in futures]
    assert_hf_beams(tiny_llama_dir, results)
    assert stack.wait_exit(draining) == 0
    after = pool_stats(stack)
    assert pools_by_name(stack)[draining].kv_migrations_out > moved_before
    assert after.restarted_requests == before.restarted_requests  # nothing started over
    wait_until_idle(stack, skip=(draining,))
    stack.restart(draining)
    wait_healthy_pools(stack)
    assert_all_alive(stack)


def test_restart_waits_for_a_just_killed_service_and_refuses_a_running_one(stack, reference):
    """`restart` at once after a SIGKILL waits for the exit (the worker may still be dying,
    or be a zombie its parent, the fork server, has not reaped: both answer kill(0)), then
    starts it; a service still running after `exit_timeout_s` is refused and left alone."""
    wait_healthy_pools(stack)
    victim = names(stack, "decode")[0]
    old = stack.process(victim)
    stack.signal(victim, signal.SIGKILL)
    new = stack.restart(victim)  # no wait_exit first
    assert new.pid != old.pid and not stack.alive(old) and stack.process(victim) is new
    wait_healthy_pools(stack)
    completion = generate(stack.spec.gateway_address, greedy_request(PROMPTS[1], 24))
    assert completion.token_ids == reference[PROMPTS[1]][:24]

    running = names(stack, "prefill")[0]
    pid = stack.process(running).pid
    refused_at = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"{running} is still running \(pid {pid}\)"):
        stack.restart(running, exit_timeout_s=0.3)
    assert time.monotonic() - refused_at >= 0.3  # it waited, then refused
    assert stack.process(running).pid == pid and stack.alive(stack.process(running))
    assert health_status(stack.process(running).address) == "SERVING"
    wait_until_idle(stack)
    assert_all_alive(stack)
