"""Scheduler features end to end on the real services, checked against HF `generate`:
prefix caching (prefill hits and decode-side reuse), chunked prefill, preemption by
recompute and by swap, several prefill and decode workers, async and sync scheduling.
After every scenario every pool is back to all-free and passes its integrity check.
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from common.pb.tandem.v1 import generate_pb2, generate_pb2_grpc
from tests.hf_reference import hf_greedy, hf_tokenizer
from tests.service.test_e2e import run_concurrently
from tests.stack_client import (
    SMALL_POOLS,
    generate,
    greedy_request,
    log_lines_since,
    log_size,
    pool_stats,
    start_stack,
    wait_until_idle,
)

SHARED = "Paged attention keeps keys and values in blocks; a block table maps positions."


def workload(tokenizer) -> list[tuple[list[int], int]]:
    """Prompts that share a 3-block prefix, plus unrelated ones; lengths fit context 96.

    Sized to preempt on `SMALL_POOLS` when run `held` (queued together, see
    `held_together`): 4 prompts of 51-62 tokens (4 blocks, 3 of them the shared prefix) and
    3 of 2-8 tokens, each decoding 34-40 tokens, grow to 6 and 3 blocks: 24 blocks at the
    least (the prefix held once) against a decode pool of 10 (two pools hold 20). Their
    246 prompt tokens take at most 11 prefill steps of 24 (about 5 once the prefix is
    cached), far fewer than the 34-40 decode steps each request then needs (without
    speculative decoding): they overlap in the decode pool(s) and outgrow them."""
    shared = tokenizer.encode(SHARED)
    prefix = (shared * 4)[:48]
    suffixes = ["alpha beta", "gamma delta epsilon", "zeta", "eta theta iota kappa"]
    prompts = [prefix + tokenizer.encode(" " + s) for s in suffixes]
    prompts += [tokenizer.encode(t) for t in ("Once upon a time", "In the beginning", "a b")]
    return [(p, min(40, 96 - len(p))) for p in prompts]


def check_against_hf(model: Path, work, results) -> None:
    for (prompt, max_tokens), got in zip(work, results, strict=True):
        assert got.token_ids == hf_greedy(model, prompt, max_tokens), prompt


def finished_lines(stack, since: int = 0) -> list[dict]:
    """The scheduler's request_finished lines (logged after byte `since`)."""
    return [json.loads(x) for x in log_lines_since(stack, since) if '"request_finished"' in x]


def test_two_prefill_two_decode_with_prefix_hits_chunking_and_preemption(tiny_llama_dir, tmp_path):
    stack = start_stack(
        tiny_llama_dir, tmp_path / "run", prefill=2, decode=2, extra_args=SMALL_POOLS
    )
    try:
        work = workload(hf_tokenizer(str(tiny_llama_dir)))  # its docstring: why it preempts
        first = run_concurrently(stack.spec.gateway_address, work, held=stack)
        check_against_hf(tiny_llama_dir, work, first)
        wait_until_idle(stack)
        second = run_concurrently(stack.spec.gateway_address, work, held=stack)  # again
        check_against_hf(tiny_llama_dir, work, second)
        stats = wait_until_idle(stack)
        prefill = [p for p in stats.pools if p.role == 1]
        decode = [p for p in stats.pools if p.role == 2]
        assert len(prefill) == len(decode) == 2
        assert all(p.steps > 0 for p in stats.pools), "placement used every worker"
        assert sum(p.prefix_hit_tokens for p in prefill) > 0
        assert sum(g.usage.cached_tokens for g in second) > 0
        assert sum(p.preemptions for p in stats.pools) > 0, "small pools must preempt"
        assert sum(p.kv_blocks_reused for p in decode) > 0, "decode-side reuse"
        assert all(p.num_free_blocks == p.num_blocks for p in stats.pools)
    finally:
        stack.stop()


def test_repeated_prompt_reports_cached_tokens_and_sends_only_missing_blocks(
    tiny_llama_dir, api_stack
):
    """On the shared default stack; its own cache_salt keeps other tests' blocks apart."""
    stack = api_stack
    prompt = list(range(5, 45))  # 40 tokens: 2 full 16-token blocks + 8

    def salted(salt: str):
        request = greedy_request(prompt, 6)
        request.cache_salt = salt
        return request

    got = generate(stack.spec.gateway_address, salted("repeated-prompt"))
    assert got.usage.cached_tokens == 0
    before = {p.role: p for p in wait_until_idle(stack).pools}
    again = generate(stack.spec.gateway_address, salted("repeated-prompt"))
    assert again.token_ids == got.token_ids == hf_greedy(tiny_llama_dir, prompt, 6)
    assert again.usage.cached_tokens == 32  # the last token's block is recomputed
    after = {p.role: p for p in wait_until_idle(stack).pools}
    decode_before, decode_after = before[2], after[2]
    # The decode pool already held both full blocks: only the partial one crossed UCX.
    assert decode_after.kv_blocks_reused - decode_before.kv_blocks_reused == 2
    assert decode_after.kv_blocks_received - decode_before.kv_blocks_received == 1
    # A different cache_salt shares nothing.
    assert generate(stack.spec.gateway_address, salted("tenant-b")).usage.cached_tokens == 0
    with grpc.insecure_channel(stack.spec.gateway_address) as channel:
        stub = generate_pb2_grpc.GenerateServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(salted("x" * 257), timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "cache_salt must be at most 256 bytes" in caught.value.details()
    wait_until_idle(stack)


def test_swap_preemption_keeps_outputs_exact(tiny_llama_dir, small_pools_stack):
    stack = small_pools_stack("swap")  # shared: counters and log compared with before
    was = next(p for p in pool_stats(stack).pools if p.role == 2)
    mark = log_size(stack)
    work = workload(hf_tokenizer(str(tiny_llama_dir)))  # its docstring: why it preempts
    results = run_concurrently(stack.spec.gateway_address, work, held=stack)
    check_against_hf(tiny_llama_dir, work, results)
    stats = wait_until_idle(stack)
    decode = next(p for p in stats.pools if p.role == 2)
    assert decode.preemptions > was.preemptions and decode.swap_outs > was.swap_outs
    assert decode.num_swap_blocks > 0 and decode.num_free_swap_blocks == decode.num_swap_blocks
    assert any(line["preemptions"] for line in finished_lines(stack, since=mark))


@pytest.mark.parametrize("async_scheduling", ["true", "false"])
def test_both_role_worker_async_and_sync_scheduling_equal_hf(
    tiny_llama_dir, tmp_path, async_scheduling
):
    args = {
        "both": SMALL_POOLS["decode"],
        "scheduler": [*SMALL_POOLS["scheduler"], "--async-scheduling", async_scheduling],
    }
    stack = start_stack(
        tiny_llama_dir, tmp_path / "run", prefill=0, decode=0, both=1, extra_args=args
    )
    try:
        # One worker runs every step: the 7 queued together (`held`) are admitted within a
        # few steps and grow a token a step each, to 24 blocks or more in a pool of 10.
        work = workload(hf_tokenizer(str(tiny_llama_dir)))
        results = run_concurrently(stack.spec.gateway_address, work, held=stack)
        check_against_hf(tiny_llama_dir, work, results)
        (pool,) = wait_until_idle(stack).pools
        assert pool.steps > 0 and pool.preemptions > 0
        assert pool.mean_step_interval_ms > 0 and pool.mean_execute_ms > 0
        # Over the same steps, results are never closer than the steps take.
        assert pool.mean_step_overhead_ms >= 0
    finally:
        stack.stop()


def test_prefix_caching_can_be_switched_off(tiny_llama_dir, tmp_path):
    args = {"scheduler": ["--enable-prefix-caching", "false"]}
    stack = start_stack(tiny_llama_dir, tmp_path / "run", extra_args=args)
    try:
        prompt = list(range(5, 45))
        generate(stack.spec.gateway_address, greedy_request(prompt, 4))
        again = generate(stack.spec.gateway_address, greedy_request(prompt, 4))
        assert again.usage.cached_tokens == 0
        stats = wait_until_idle(stack)
        assert all(p.num_cached_blocks == 0 and p.kv_blocks_reused == 0 for p in stats.pools)
    finally:
        stack.stop()


def test_generate_usage_fields_are_consistent(api_stack):
    # Guard: GenerateResponse.usage on the last message only, cached <= prompt tokens.
    request = greedy_request(list(range(7, 60)), 5)
    request.cache_salt = "usage-fields"  # apart from the other tests on the shared stack
    for _ in range(2):
        with grpc.insecure_channel(api_stack.spec.gateway_address) as channel:
            stub = generate_pb2_grpc.GenerateServiceStub(channel)
            messages = list(stub.Generate(request, timeout=60))
        assert all(not m.HasField("usage") for m in messages[:-1])
        usage = messages[-1].usage
        assert usage.cached_tokens <= usage.prompt_tokens == 53
        assert messages[-1].finish_reason == generate_pb2.FINISH_REASON_LENGTH
    assert usage.cached_tokens == 48  # second pass: 3 of the 53 tokens' blocks cached
    wait_until_idle(api_stack)


def test_streamed_layer_by_layer_pull_with_chunked_prompts_equals_hf(tiny_llama_dir, tmp_path):
    """Same-host workers pull KV out of the prefill worker's shared pool, the transfer
    started with a prompt's first chunk and each chunk's finished blocks pulled as that
    chunk completes (24-token chunks end inside blocks; with the copy-size floor at 0,
    each layer is copied as soon as it is final). Output equals HF, the
    transfers report the lag from the prompt's last layer, and every block comes back.
    (That layers are copied while the step runs is shown in test_kv_shared_pull.py.)"""
    stack = start_stack(
        tiny_llama_dir,
        tmp_path / "run",
        extra_args={
            "prefill": ["--max-model-len", "96"],
            "decode": ["--max-model-len", "96", "--kv-transfer-stream-min-copy-bytes", "0"],
            "scheduler": ["--max-num-batched-tokens", "24"],
        },
    )
    try:
        work = workload(hf_tokenizer(str(tiny_llama_dir)))
        check_against_hf(tiny_llama_dir, work, run_concurrently(stack.spec.gateway_address, work))
        stats = wait_until_idle(stack)
        (decode,) = [p for p in stats.pools if p.role == 2]
        assert decode.kv_transfers >= len(work) - 1  # (a hit on every block moves none)
        assert decode.kv_source_lag_ms_total > 0  # pulled with the prompt's step: streamed
        assert all(p.num_free_blocks == p.num_blocks for p in stats.pools)
        logs = (Path(stack.run_dir) / "logs").glob("decode-*.log")
        assert any('"kv_peer_mapped"' in log.read_text() for log in logs)  # the pull path
    finally:
        stack.stop()
