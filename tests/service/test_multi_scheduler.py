"""One gateway in front of two schedulers, each with its own prefill and decode worker
(every service a real process): answers stay HF-exact, a shared prefix keeps going to the
scheduler that caches it — by the schedulers' KV events, also where the gateway's memory
of what it sent is wrong (the scheduler it sent the prefix to reset its cache, and traffic
the gateway never saw cached it on the other) — and each scheduler's KV event metrics
equal what its pools cache, distinct prompts spread over both, a LoRA adapter loaded through
the gateway is loaded on (and served PEFT-exact by) both, and a scheduler SIGKILLed
mid-load fails only its own streams (those that had not streamed a token yet are retried
on the survivor), after which everything goes to the survivor and its pools are clean.

One stack for the module; the kill test comes last.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import grpc
import pytest

from common.healthcheck import health_status
from common.pb.tandem.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from common.pb.tandem.v1 import generate_pb2, generate_pb2_grpc
from services.stack.launcher import Stack
from tests.hf_reference import hf_greedy, hf_tokenizer
from tests.service.test_e2e import WORKLOAD, expected, run_concurrently
from tests.service.test_e2e_lora import all_at_once
from tests.stack_client import (
    SAMPLE_PROMPTS,
    BackgroundStream,
    generate,
    greedy_request,
    pool_stats,
    scrape,
    total,
    wait_until_idle,
)
from tests.unit.test_lora_batched import adapters, peft_merged_greedy  # noqa: F401  (fixture)

LONG_OUTPUT = 96
PREFIX = list(range(3, 51))  # 48 token ids: three full 16-token blocks


@pytest.fixture(scope="module")
def stack(module_stacks):
    lora = ["--enable-lora"]
    return module_stacks(
        name="msched",
        schedulers=2,
        ready_timeout_s=240,
        extra_args={"prefill": lora, "decode": lora, "gateway": ["--allow-runtime-lora-updating"]},
        metrics=True,  # the gateway's requests open per scheduler
    )


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """HF greedy ids of every sample prompt, LONG_OUTPUT tokens (shorter runs: prefixes)."""
    tokenizer = hf_tokenizer(str(tiny_llama_dir))
    return {p: hf_greedy(tiny_llama_dir, tokenizer.encode(p), LONG_OUTPUT) for p in SAMPLE_PROMPTS}


def computed(stack: Stack) -> dict[str, int]:
    """Prompt tokens each scheduler's pools computed so far (grows when it serves one)."""
    return {
        address: sum(p.prompt_tokens_computed for p in pool_stats(stack, address).pools)
        for address in stack.spec.scheduler_addresses
    }


def prefix_hits(stack: Stack, address: str) -> int:
    return sum(p.prefix_hit_tokens for p in pool_stats(stack, address).pools)


def grew(before: dict[str, int], after: dict[str, int]) -> list[str]:
    return [address for address in before if after[address] > before[address]]


def wait_all_idle(stack: Stack, addresses: list[str] | None = None) -> None:
    for address in addresses or stack.spec.scheduler_addresses:
        wait_until_idle(stack, scheduler=address)


def server_load(stack: Stack) -> generate_pb2.GetServerLoadResponse:
    with grpc.insecure_channel(stack.spec.gateway_address) as channel:
        return generate_pb2_grpc.GenerateServiceStub(channel).GetServerLoad(
            generate_pb2.GetServerLoadRequest(), timeout=10
        )


def gateway_events(stack: Stack, event: str) -> int:
    log = Path(stack.process("gateway").log).read_text(errors="replace")
    lines = (json.loads(line) for line in log.splitlines() if line.startswith("{"))
    return sum(1 for line in lines if line.get("event") == event)


def prefixed(tail: list[int], max_tokens: int, model) -> tuple[list[int], list[int]]:
    prompt = PREFIX + tail
    return prompt, hf_greedy(model, prompt, max_tokens)


def test_concurrent_mixed_workload_is_hf_exact_and_both_schedulers_take_part(stack, tiny_llama_dir):
    assert stack.spec.num_schedulers == 2
    load = server_load(stack)
    assert len(load.workers) == 4  # the gateway sums both schedulers' pools
    before = computed(stack)
    results = run_concurrently(stack.spec.gateway_address, WORKLOAD)
    for (prompt, max_tokens), got in zip(WORKLOAD, results, strict=True):
        want_ids, want_text = expected(tiny_llama_dir, prompt, max_tokens)
        assert got.token_ids == want_ids, prompt
        assert got.text == want_text, prompt
    assert sorted(grew(before, computed(stack))) == sorted(stack.spec.scheduler_addresses)
    wait_all_idle(stack)


def test_requests_sharing_a_prefix_land_on_the_scheduler_that_caches_it(stack, tiny_llama_dir):
    before = computed(stack)
    first_prompt, first_want = prefixed([7], 12, tiny_llama_dir)
    assert generate(stack.spec.gateway_address, greedy_request(first_prompt, 12)).token_ids == (
        first_want
    )
    (home,) = grew(before, computed(stack))
    hits = prefix_hits(stack, home)
    others = {a: n for a, n in computed(stack).items() if a != home}
    for tail in ([8, 9], [10], [11, 12, 13]):
        prompt, want = prefixed(tail, 12, tiny_llama_dir)
        got = generate(stack.spec.gateway_address, greedy_request(prompt, 12))
        assert got.token_ids == want
        assert got.usage.cached_tokens >= len(PREFIX)  # served from the prefix cache
    after = computed(stack)
    assert {a: after[a] for a in others} == others  # the other scheduler saw none of them
    assert prefix_hits(stack, home) >= hits + 3 * len(PREFIX)
    wait_all_idle(stack)


def test_distinct_prompts_spread_over_both_schedulers(stack, reference):
    before = computed(stack)
    prompts = [(p, 8) for p in SAMPLE_PROMPTS]
    results = run_concurrently(stack.spec.gateway_address, prompts)
    for (prompt, _), got in zip(prompts, results, strict=True):
        assert got.token_ids == reference[prompt][:8], prompt
    assert sorted(grew(before, computed(stack))) == sorted(stack.spec.scheduler_addresses)
    # One at a time (no load difference), they still take turns.
    before = computed(stack)
    for prompt in SAMPLE_PROMPTS[:4]:
        got = generate(stack.spec.gateway_address, greedy_request(prompt, 4))
        assert got.token_ids == reference[prompt][:4]
    assert len(grew(before, computed(stack))) == 2
    wait_all_idle(stack)


def submit_directly(address: str, prompt: list[int], max_tokens: int) -> list[int]:
    """Run a request on one scheduler's own Session, not through the gateway."""
    submit = scheduler_pb2.SubmitRequest(
        request_id=f"direct-{time.monotonic_ns()}", prompt_token_ids=prompt, max_tokens=max_tokens
    )
    with grpc.insecure_channel(address) as channel:
        responses = scheduler_pb2_grpc.SchedulerServiceStub(channel).Session(
            iter([scheduler_pb2.SessionRequest(submit=submit)]), timeout=60
        )
        updates = [u for r in responses for u in r.updates]
    assert updates and not updates[-1].error_code, updates[-1:]
    return [t for u in updates for t in u.token_ids]


def reset_prefix_cache(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return (
            scheduler_pb2_grpc.SchedulerServiceStub(channel)
            .ResetPrefixCache(scheduler_pb2.ResetPrefixCacheRequest(), timeout=10)
            .num_blocks_dropped
        )


def routed_blocks(stack: Stack, address: str) -> float:
    """The prompt blocks the gateway's router knows `address` caches, from its events."""
    samples = scrape(stack.process("gateway").metrics)
    assert total(samples, "tandem:router_kv_events_synced", scheduler=address) == 1
    return total(samples, "tandem:router_kv_blocks", scheduler=address)


def test_a_shared_prefix_follows_the_kv_events_where_the_memory_of_what_was_sent_is_wrong(
    stack, tiny_llama_dir
):
    address = stack.spec.gateway_address
    prefix = list(range(300, 300 + len(PREFIX)))  # new to both schedulers
    before = computed(stack)
    prompt, want = prefix + [7], hf_greedy(tiny_llama_dir, prefix + [7], 6)
    assert generate(address, greedy_request(prompt, 6)).token_ids == want
    (home,) = grew(before, computed(stack))
    (other,) = [a for a in stack.spec.scheduler_addresses if a != home]
    wait_all_idle(stack)
    # The scheduler the gateway sent the prefix to forgets its cache (every block is free
    # once idle); traffic the gateway never sees caches the prefix on the other one.
    assert reset_prefix_cache(home) >= len(PREFIX) // 16
    known = routed_blocks(stack, other)
    submit_directly(other, prefix + [8], 4)
    wait_for(lambda: routed_blocks(stack, home) == 0, "the gateway saw the reset")
    wait_for(lambda: routed_blocks(stack, other) >= known + 3, "the gateway saw the prefix")
    # The gateway's memory of what it sent says `home`; the events say `other`.
    for tail in ([9], [10, 11]):
        before = computed(stack)
        prompt = prefix + tail
        got = generate(address, greedy_request(prompt, 6))
        assert got.token_ids == hf_greedy(tiny_llama_dir, prompt, 6)
        assert got.usage.cached_tokens >= len(prefix)  # served from other's cache
        assert grew(before, computed(stack)) == [other]
    wait_all_idle(stack)
    # Each scheduler's events tell what its pools cache.
    for scheduler in stack.spec.scheduler_addresses:
        name = stack.spec.scheduler_name(stack.spec.scheduler_addresses.index(scheduler))
        metrics = stack.process(name).metrics

        def events_match(scheduler=scheduler, metrics=metrics) -> bool:
            held = scrape(metrics)
            return all(
                total(held, "tandem:kv_blocks_held", worker_id=p.worker_id, medium="GPU")
                == p.num_cached_blocks
                for p in pool_stats(stack, scheduler).pools
            )

        wait_for(events_match, f"{scheduler}'s events match its pools")


def gateway_call(stack: Stack, method: str, request):
    with grpc.insecure_channel(stack.spec.gateway_address) as channel:
        return getattr(generate_pb2_grpc.GenerateServiceStub(channel), method)(request, timeout=60)


def scheduler_adapters(address: str) -> set[str]:
    with grpc.insecure_channel(address) as channel:
        reply = scheduler_pb2_grpc.SchedulerServiceStub(channel).ListLoraAdapters(
            scheduler_pb2.ListLoraAdaptersRequest(), timeout=10
        )
    return {a.lora_name for a in reply.adapters}


def test_lora_adapter_loads_and_unloads_on_every_scheduler(
    stack,
    tiny_llama_dir,
    adapters,  # noqa: F811
):
    load = generate_pb2.LoadLoraAdapterRequest(lora_name="rt", lora_path=str(adapters["mlp16"]))
    assert gateway_call(stack, "LoadLoraAdapter", load).adapter.lora_name == "rt"
    for address in stack.spec.scheduler_addresses:
        assert scheduler_adapters(address) == {"rt"}
    listed = gateway_call(stack, "ListLoraAdapters", generate_pb2.ListLoraAdaptersRequest())
    assert [a.lora_name for a in listed.adapters] == ["rt"]  # one entry, not one per scheduler
    prompts = [PREFIX[:20], PREFIX[20:][::-1]]
    want = [peft_merged_greedy(tiny_llama_dir, adapters["mlp16"], p, 10) for p in prompts]
    assert want[0] != hf_greedy(tiny_llama_dir, prompts[0], 10)  # the adapter matters
    before = computed(stack)
    requests = []
    for prompt in prompts:
        requests.append(greedy_request(prompt, 10))
        requests[-1].lora_name = "rt"
    results = all_at_once(stack.spec.gateway_address, requests)
    assert [r.token_ids for r in results] == want
    assert len(grew(before, computed(stack))) == 2  # each scheduler served one
    unload = generate_pb2.UnloadLoraAdapterRequest(lora_name="rt")
    gateway_call(stack, "UnloadLoraAdapter", unload)
    for address in stack.spec.scheduler_addresses:
        assert scheduler_adapters(address) == set()
    with pytest.raises(grpc.RpcError) as gone:
        generate(stack.spec.gateway_address, requests[0])
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    wait_all_idle(stack)


def test_scheduler_killed_mid_load_fails_only_its_streams_and_the_survivor_takes_over(
    stack, tiny_llama_dir, reference
):
    address = stack.spec.gateway_address
    # A prefix the router sends to one scheduler: that one will be killed.
    before = computed(stack)
    prompt, want = prefixed([20], 8, tiny_llama_dir)
    assert generate(address, greedy_request(prompt, 8)).token_ids == want
    (victim,) = grew(before, computed(stack))
    (survivor,) = [a for a in stack.spec.scheduler_addresses if a != victim]
    victim_name = stack.spec.scheduler_name(stack.spec.scheduler_addresses.index(victim))

    # And one the router sends to the other (the survivor): each group below is routed by
    # its prefix, whatever the timing.
    for first in (60, 120, 180):
        survivor_prefix = list(range(first, first + len(PREFIX)))
        before = computed(stack)
        generate(address, greedy_request(survivor_prefix + [1], 2))
        if grew(before, computed(stack)) == [survivor]:
            break
    else:
        raise AssertionError("no prefix went to the survivor")

    def streams(prompts, max_tokens):
        return [
            BackgroundStream(address, greedy_request(p, max_tokens), timeout=60) for p in prompts
        ]

    victim_prompts = [PREFIX + tail for tail in ([30], [31, 32], [33])]
    survivor_prompts = [survivor_prefix + tail for tail in ([30], [31, 32], [33])]
    retried_prompts = [PREFIX + tail for tail in ([21], [22, 23])]
    on_victim = streams(victim_prompts, LONG_OUTPUT)
    wait_for(lambda: any(len(s.token_ids) >= 2 for s in on_victim), "a token from the victim")
    stack.signal(victim_name, signal.SIGSTOP)
    # Frozen, the victim still gets requests that share its prefix, and streams them nothing.
    retries_before = gateway_events(stack, "retrying_on_another_scheduler")
    retried = streams(retried_prompts, 16)
    on_survivor = streams(survivor_prompts, LONG_OUTPUT)
    for stream in on_survivor:
        stream.wait_tokens(2)  # the survivor streams meanwhile
    gateway = stack.process("gateway").metrics

    def open_on_victim() -> float:
        return total(scrape(gateway), "tandem:scheduler_requests_open", scheduler=victim)

    # The retried requests are on the frozen victim's session (the gateway's gauge counts
    # them) before it is killed: they must be retried, not routed elsewhere at first.
    wait_for(lambda: open_on_victim() >= len(on_victim) + len(retried), "routed to the victim")
    stack.signal(victim_name, signal.SIGKILL)
    killed_at = time.monotonic()
    stack.wait_exit(victim_name)
    # What the victim had not streamed anything of is retried on the survivor; what it had
    # begun fails; the survivor's streams are untouched.
    for prompt, stream in zip(retried_prompts, retried, strict=True):
        stream.result(timeout_s=60)
        assert stream.code == grpc.StatusCode.OK, (stream.code, stream.details)
        assert stream.token_ids == hf_greedy(tiny_llama_dir, prompt, 16)
    assert gateway_events(stack, "retrying_on_another_scheduler") >= retries_before + 2
    for prompt, stream in zip(survivor_prompts, on_survivor, strict=True):
        stream.result(timeout_s=60)
        assert stream.code == grpc.StatusCode.OK, (stream.code, stream.details)
        assert stream.token_ids == hf_greedy(tiny_llama_dir, prompt, LONG_OUTPUT)
    failed = 0
    for prompt, stream in zip(victim_prompts, on_victim, strict=True):
        stream.result(timeout_s=60)
        want = hf_greedy(tiny_llama_dir, prompt, LONG_OUTPUT)
        if stream.code == grpc.StatusCode.OK:  # nothing streamed before the freeze: retried
            assert stream.token_ids == want
            continue
        assert stream.code == grpc.StatusCode.UNAVAILABLE, (stream.code, stream.details)
        assert stream.ended_at - killed_at < 5  # failed at once, not hung
        assert 1 <= len(stream.token_ids) < len(want)  # it had streamed some
        assert stream.token_ids == want[: len(stream.token_ids)]  # HF's tokens so far
        failed += 1
    assert failed >= 1

    # Afterwards every request goes straight to the survivor and succeeds.
    assert health_status(address) == "SERVING"
    assert {w.worker_id for w in server_load(stack).workers} == {
        p.worker_id for p in pool_stats(stack, survivor).pools
    }
    retries_before = gateway_events(stack, "retrying_on_another_scheduler")
    survivor_before = computed_on(stack, survivor)
    for prompt in SAMPLE_PROMPTS[:3]:
        assert generate(address, greedy_request(prompt, 6)).token_ids == reference[prompt][:6]
    prompt, want = prefixed([24], 6, tiny_llama_dir)
    assert generate(address, greedy_request(prompt, 6)).token_ids == want
    assert computed_on(stack, survivor) > survivor_before
    assert gateway_events(stack, "retrying_on_another_scheduler") == retries_before
    wait_all_idle(stack, [survivor])


def wait_for(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not after {timeout_s}s"
        time.sleep(0.005)


def computed_on(stack: Stack, address: str) -> int:
    return sum(p.prompt_tokens_computed for p in pool_stats(stack, address).pools)
