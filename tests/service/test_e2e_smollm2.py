"""HF parity on a real model: SmolLM2-135M-Instruct (the default model: 30 layers, 9 query
and 3 KV heads of 64, tied embeddings, ChatML) served by the real services, its greedy
output equal to HF `generate` (float32) token for token on each scheduling path the tiny
models' parity tests cover: chunked prompts handed to a decode worker with their KV,
prefix-cache hits, preemption, and a draining decode worker moving its requests away
mid-generation.

One stack for the module (1 prefill + 2 decode workers, each loading the ~540 MB of
float32 weights) with pools small enough that every event follows from arithmetic:

- context 128 tokens (8 blocks of 16); a step budget of 24 tokens, so every prompt here
  (34-56 tokens, the chat one rendered with the checkpoint's template) runs in 2-3 chunks;
- a decode pool of 8 blocks per worker: 8 x 720 KiB (30 layers x K and V x 3 KV heads x
  64 x 16 tokens x 4 bytes per block), room for two of these requests when they arrive
  and not for two at their full length; the prefill pool has 24 blocks, enough for
  every prompt queued at once.

The scheduler misses health checks only while a test freezes a worker (SIGSTOP, a few
seconds at most): it tolerates 20 misses in a row, of 0.25-0.75 s each. The migration test
drains a decode worker for good, so it runs last.
"""

from __future__ import annotations

import math
import signal
import time

import grpc
import pytest

from common.pb.tandem.v1 import generate_pb2
from tests.hf_reference import hf_greedy, hf_tokenizer
from tests.stack_client import (
    BackgroundStream,
    Completion,
    frozen,
    generate,
    generate_together,
    greedy_request,
    pool_stats,
    wait_until_idle,
    worker_names,
)

STEP_BUDGET = 24
CONTEXT = 128
DECODE_BLOCKS = 8
BLOCK = 16
MAX_TOKENS = 32
PREFILL, DECODE = 1, 2  # WorkerRole

LONG_A = (
    "Paged attention stores keys and values in fixed-size blocks, and a block table maps "
    "each sequence's logical positions to physical blocks anywhere in the pool, so memory "
    "is allocated on demand."
)  # 38 tokens
LONG_B = (
    "The lighthouse keeper climbed the narrow stairs every evening to light the lamp, and "
    "every morning he wrote in his ledger the names of the ships that had passed in the night."
)  # 34 tokens
SHARED = (
    "A scheduler for a language model server decides, at every step, which requests run and "
    "how many of their prompt tokens it computes; the key and value vectors of every token it "
    "has computed live in blocks of sixteen tokens in a pool on each worker."
)  # 50 tokens: its first 48 are three full blocks
SUFFIXES = (" Explain why the blocks are that size.", " Now write a haiku about it:")
CHAT = [{"role": "user", "content": "Write one sentence about the sea."}]  # 37 tokens rendered
SHORT = "Once upon a time"


@pytest.fixture(scope="module")
def stack(smollm2_dir, module_stacks):
    model = ["--max-model-len", str(CONTEXT)]
    return module_stacks(
        smollm2_dir,
        name="smollm2",
        prefill=1,
        decode=2,
        extra_args={
            "prefill": [*model, "--num-blocks", "24"],
            "decode": [*model, "--num-blocks", str(DECODE_BLOCKS), "--drain-timeout-s", "60"],
            "scheduler": [
                "--max-num-batched-tokens", str(STEP_BUDGET),
                "--worker-health-interval-s", "0.25",
                "--worker-health-timeout-s", "0.5",
                "--worker-health-max-misses", "20",
            ],
        },
    )  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return hf_tokenizer(str(smollm2_dir))


@pytest.fixture(scope="module")
def prompts(tokenizer) -> dict[str, list[int]]:
    """Every prompt of the module as token ids (the chat one as the template renders it)."""
    prefix = tokenizer.encode(SHARED)[:48]
    chat = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)["input_ids"]
    return {
        "long_a": tokenizer.encode(LONG_A),
        "long_b": tokenizer.encode(LONG_B),
        "chat": list(chat),
        "prefix_1": prefix + tokenizer.encode(SUFFIXES[0]),
        "prefix_2": prefix + tokenizer.encode(SUFFIXES[1]),
        "short": tokenizer.encode(SHORT),
    }


def by_worker(stats) -> dict[str, object]:
    return {p.worker_id: p for p in stats.pools}


def delta(after, before, field: str, role: int) -> int:
    """How much `field` grew over the pools of `role`."""
    was = by_worker(before)
    return sum(
        getattr(p, field) - getattr(was[p.worker_id], field) for p in after.pools if p.role == role
    )


def assert_hf_exact(model, prompt_ids: list[int], max_tokens: int, got: Completion, tokenizer):
    want = hf_greedy(model, prompt_ids, max_tokens)
    assert got.token_ids == want, (tokenizer.decode(prompt_ids), got.text)
    stopped = want[-1] == tokenizer.eos_token_id
    assert got.finish_reason == (
        generate_pb2.FINISH_REASON_STOP if stopped else generate_pb2.FINISH_REASON_LENGTH
    )
    assert got.usage.prompt_tokens == len(prompt_ids)
    assert got.usage.completion_tokens == len(want)


def chat_request(max_tokens: int) -> generate_pb2.GenerateRequest:
    request = generate_pb2.GenerateRequest(max_tokens=max_tokens)
    for message in CHAT:
        request.chat.messages.add(**message)
    request.sampling.temperature = 0.0
    return request


def salted(request: generate_pb2.GenerateRequest, salt: str) -> generate_pb2.GenerateRequest:
    request.cache_salt = salt  # apart from every other test's prefix-cache blocks
    return request


def test_chunked_prompts_decoded_on_a_decode_worker_equal_hf(
    stack, smollm2_dir, tokenizer, prompts
):
    """A text prompt (tokenized by the gateway) and a chat one (rendered by the gateway
    with the checkpoint's ChatML template), each longer than the step budget: each runs in
    ceil(n / 24) = 2 prefill steps, alone (sent one after the other), and its KV crosses to
    a decode worker, which decodes the rest. Salted: no prefix of them is cached."""
    cases = [
        (salted(greedy_request(LONG_A, MAX_TOKENS), "chunked"), prompts["long_a"]),
        (salted(chat_request(MAX_TOKENS), "chunked"), prompts["chat"]),
    ]
    assert all(len(ids) > STEP_BUDGET for _, ids in cases)
    before = wait_until_idle(stack)
    results = [generate(stack.spec.gateway_address, request) for request, _ in cases]
    after = wait_until_idle(stack)
    for (_, ids), got in zip(cases, results, strict=True):
        assert_hf_exact(smollm2_dir, ids, MAX_TOKENS, got, tokenizer)
        want = hf_greedy(smollm2_dir, ids, MAX_TOKENS)
        assert got.text == tokenizer.decode(want, skip_special_tokens=True)
        assert got.usage.cached_tokens == 0
    assert results[1].finish_reason == generate_pb2.FINISH_REASON_STOP  # ended at <|im_end|>
    computed = sum(len(ids) for _, ids in cases)
    assert delta(after, before, "prompt_tokens_computed", PREFILL) == computed
    chunks = sum(math.ceil(len(ids) / STEP_BUDGET) for _, ids in cases)
    assert chunks == 4 and delta(after, before, "steps", PREFILL) >= chunks
    assert delta(after, before, "kv_transfers", DECODE) == len(cases)  # P/D: both moved
    assert delta(after, before, "kv_blocks_received", DECODE) > 0
    assert delta(after, before, "steps", DECODE) > 0
    assert delta(after, before, "prompt_tokens_computed", DECODE) == 0


def test_a_cached_prefix_is_reused_and_output_stays_exact(stack, smollm2_dir, tokenizer, prompts):
    """Two prompts sharing their first 48 tokens (three full blocks), sent one after the
    other: the second finds those blocks in the prefill pool's prefix cache and computes
    only its own 8 tokens; both equal HF."""
    first_ids, second_ids = prompts["prefix_1"], prompts["prefix_2"]
    assert first_ids[:48] == second_ids[:48] and first_ids[48] != second_ids[48]
    address = stack.spec.gateway_address
    before = wait_until_idle(stack)
    first = generate(address, salted(greedy_request(first_ids, MAX_TOKENS), "prefix-hits"))
    assert first.usage.cached_tokens == 0
    middle = wait_until_idle(stack)
    second = generate(address, salted(greedy_request(second_ids, MAX_TOKENS), "prefix-hits"))
    after = wait_until_idle(stack)
    assert second.usage.cached_tokens == 48
    assert delta(after, middle, "prefix_hit_tokens", PREFILL) == 48
    assert delta(after, middle, "prompt_tokens_computed", PREFILL) == len(second_ids) - 48
    assert delta(middle, before, "prompt_tokens_computed", PREFILL) == len(first_ids)
    assert_hf_exact(smollm2_dir, first_ids, MAX_TOKENS, first, tokenizer)
    assert_hf_exact(smollm2_dir, second_ids, MAX_TOKENS, second, tokenizer)


def test_preemption_in_the_decode_pools_keeps_outputs_exact(stack, smollm2_dir, tokenizer, prompts):
    """Five requests queued together (`generate_together`): the four text prompts (34, 38,
    56 and 56 tokens, the last two sharing 48) and the chat one (37), 32 tokens each (the
    text ones run to the length: checked against HF below).

    Their 221 prompt tokens take at most ceil(221 / 24) = 10 prefill steps (fewer with the
    shared prefix), while each request then decodes for 31 steps: all of them reach the
    decode pools while the first ones are still decoding. Each arrives with 3-4 blocks
    (its prompt and first token), so a pool of 8 takes at most two at a time (a request is
    placed with a block of headroom); at their full length the text requests hold 5-6
    blocks each (34 + 32 = 66 tokens and up), so any two of them running together in one
    pool need 10 blocks or more of its 8 before either finishes. With five requests and
    two pools, two run together in one pool: it must preempt."""
    names = ["long_a", "long_b", "prefix_1", "prefix_2", "chat"]
    work = [prompts[n] for n in names]
    before = wait_until_idle(stack)
    results = generate_together(stack, [greedy_request(ids, MAX_TOKENS) for ids in work])
    after = wait_until_idle(stack)
    for name, ids, got in zip(names, work, results, strict=True):
        assert_hf_exact(smollm2_dir, ids, MAX_TOKENS, got, tokenizer)
        if name != "chat":
            assert len(got.token_ids) == MAX_TOKENS, name  # the arithmetic's full length
    preemptions = delta(after, before, "preemptions", DECODE)
    print(f"preemptions in the decode pools: {preemptions}")
    assert preemptions > 0, "the decode pools must preempt"
    assert all(p.num_free_blocks == p.num_blocks for p in after.pools)


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not true after {timeout_s}s"
        time.sleep(0.005)


def test_a_draining_decode_worker_hands_its_requests_over_mid_generation(
    stack, smollm2_dir, prompts
):
    """Runs last: the drained worker is gone afterwards.

    Two requests (34 + 28 and 4 + 32 tokens: 4 and 3 blocks of KV at their full length,
    so both fit together in either decode pool of 8) each stream 3 tokens: both are
    decoding on a decode worker. Both decode workers are then frozen: the one holding more
    requests is told to drain (SIGTERM, delivered as it resumes) while every request still
    has 10 or more tokens to go (checked), more than the few steps it may run before the
    scheduler sees the drain. Once thawed, the scheduler moves what it holds, KV and all,
    to the other worker; the other worker is then frozen while the drained one exits, so
    the moved requests are still unfinished when it has gone. Every output equals HF, no
    request started over, and no pool computed a prompt token after the drain began."""
    work = [(prompts["long_b"], 28), (prompts["short"], MAX_TOKENS)]
    full = [-(-(len(ids) + n - 1) // BLOCK) for ids, n in work]  # KV blocks at the end
    assert full == [4, 3] and sum(full) < DECODE_BLOCKS
    address = stack.spec.gateway_address
    decode = worker_names(stack, "decode")
    before = wait_until_idle(stack)
    streams = [BackgroundStream(address, greedy_request(ids, n), 120) for ids, n in work]
    for stream in streams:
        stream.wait_tokens(3)
    with frozen(stack, decode):
        at_sigterm = pool_stats(stack)
        held = {n: by_worker(at_sigterm)[n].num_requests for n in decode}
        draining = max(decode, key=held.get)
        other = next(n for n in decode if n != draining)
        assert held[draining] > 0 and sum(held.values()) == len(work), held
        tokens_at_sigterm = [len(s.token_ids) for s in streams]
        for (_, n), stream in zip(work, streams, strict=True):
            assert stream.code is None and len(stream.token_ids) <= n - 10, stream.token_ids
        stack.signal(draining, signal.SIGTERM)
        moved_before = by_worker(at_sigterm)[draining].kv_migrations_out

    def handed_on() -> bool:  # what it held moved, KV and all: it holds nothing
        pool = by_worker(pool_stats(stack))[draining]
        moved = pool.kv_migrations_out >= moved_before + held[draining]
        return moved and pool.num_requests == 0 and pool.num_free_blocks == pool.num_blocks

    wait_for(handed_on, 60, "the drained worker's requests moved")
    with frozen(stack, [other]):
        assert stack.wait_exit(draining, timeout_s=60) == 0
        still_running = sum(s.code is None for s in streams)
        tokens_at_exit = [len(s.token_ids) for s in streams]
    print(f"drain: {held} held, tokens at SIGTERM {tokens_at_sigterm}, at exit {tokens_at_exit}")
    assert still_running > 0  # it left while what it held was generating elsewhere

    for (ids, n), stream in zip(work, streams, strict=True):
        stream.result(timeout_s=120)
        assert stream.code == grpc.StatusCode.OK, (stream.code, stream.details)
        assert stream.token_ids == hf_greedy(smollm2_dir, ids, MAX_TOKENS)[:n]
    after = wait_until_idle(stack, skip=(draining,))
    pools, then = by_worker(after), by_worker(at_sigterm)
    assert pools[draining].kv_migrations_out - moved_before >= held[draining]
    assert pools[other].kv_blocks_received > then[other].kv_blocks_received
    assert after.restarted_requests == before.restarted_requests  # nothing started over
    for name, pool in pools.items():  # the moved requests went on from their last token
        assert pool.prompt_tokens_computed == then[name].prompt_tokens_computed, name
    # Its exit fails its pool (it would rejoin if restarted).
    wait_for(lambda: not by_worker(pool_stats(stack))[draining].healthy, 30, "pool failed")
    assert pool_stats(stack).worker_failures == before.worker_failures + 1
