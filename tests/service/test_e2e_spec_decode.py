"""Speculative decoding end to end on the real services, checked against HF `generate`.

N-gram: greedy output is HF's on Llama and Qwen2 through prefill and decode workers with
concurrency, chunked prompts, prefix hits and decode-side preemption; requests whose output
repeats itself (three tokens pushed up by logit_bias, HF's sequence_bias) get their
proposals accepted, several tokens per step; the counts reach GetPoolStats, the sample's
usage and the scheduler's log; every block comes back.

Draft model (the target as its own draft on Llama; its first layer on Qwen2, with swap
preemption): the same, across two decode workers, one of them SIGKILLed mid-generation (its
requests recompute on the other, draft KV and all)."""

from __future__ import annotations

import json
import signal

import grpc
import pytest

from tests.hf_reference import hf_generate, hf_greedy, hf_tokenizer
from tests.service.test_e2e import run_concurrently
from tests.service.test_e2e_scheduling import (
    SMALL_POOLS,
    check_against_hf,
    finished_lines,
    workload,
)
from tests.stack_client import (
    SAMPLE_PROMPTS,
    BackgroundStream,
    generate,
    greedy_request,
    pool_stats,
    start_stack,
    wait_until_idle,
)

NGRAM = json.dumps(
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
)
BIAS = {7: 30.0, 8: 30.0, 9: 30.0}


def biased(model_dir, prompt: list[int], max_tokens: int):
    """The request with logit_bias, and HF's tokens for it."""
    request = greedy_request(prompt, max_tokens)
    for token, value in BIAS.items():
        request.sampling.logit_bias[token] = value
    want = hf_generate(
        model_dir,
        prompt,
        max_new_tokens=max_tokens,
        sequence_bias={(k,): v for k, v in BIAS.items()},
    )
    return request, want


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_ngram_speculation_is_hf_exact_and_accepts_repeating_output(arch, request, tmp_path):
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    pools = dict(SMALL_POOLS)
    pools["decode"] = [*SMALL_POOLS["decode"], "--speculative-config", NGRAM]
    stack = start_stack(model_dir, tmp_path / "run", extra_args=pools)
    try:
        work = workload(hf_tokenizer(str(model_dir)))
        check_against_hf(model_dir, work, run_concurrently(stack.spec.gateway_address, work))
        # The same prompts again: prefix hits on both sides.
        check_against_hf(model_dir, work, run_concurrently(stack.spec.gateway_address, work))
        rounds = [biased(model_dir, prompt, n) for prompt, n in work[-3:]]
        for req, want in rounds:
            got = generate(stack.spec.gateway_address, req)
            assert got.token_ids == want
            assert got.usage.num_draft_tokens > 0 and got.usage.num_accepted_tokens > 0
            assert got.messages < len(want)  # several tokens landed in one step
        stats = wait_until_idle(stack)
        (decode,) = [p for p in stats.pools if p.role == 2]
        assert decode.spec_decode_num_draft_tokens >= decode.spec_decode_num_accepted_tokens > 0
        assert decode.spec_decode_num_steps > 0
        assert decode.preemptions > 0  # the small decode pool preempted meanwhile
        assert all(p.num_free_blocks == p.num_blocks for p in stats.pools)
        lines = [x for x in finished_lines(stack) if "accepted_tokens" in x]
        assert lines and all(0 <= x["acceptance_rate"] <= 1 for x in lines)
    finally:
        stack.stop()


def draft_config(model_dir, num_draft_layers=None) -> str:
    config = {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 3}
    if num_draft_layers:
        config["num_draft_layers"] = num_draft_layers
    return json.dumps(config)


@pytest.mark.parametrize(
    ("arch", "num_draft_layers", "preemption"),
    [("llama", None, "recompute"), ("qwen2", 1, "swap")],
    ids=["llama-self-draft", "qwen2-first-layer-draft-swap"],
)
def test_draft_model_speculation_is_hf_exact_through_preemption_and_a_killed_decode_worker(
    arch, num_draft_layers, preemption, request, tmp_path
):
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    spec = draft_config(model_dir, num_draft_layers)
    args = {
        "prefill": SMALL_POOLS["prefill"],
        "decode": [*SMALL_POOLS["decode"], "--speculative-config", spec],
        "scheduler": [*SMALL_POOLS["scheduler"], "--preemption-mode", preemption],
    }
    stack = start_stack(model_dir, tmp_path / "run", decode=2, extra_args=args)
    try:
        tokenizer = hf_tokenizer(str(model_dir))
        work = workload(tokenizer)
        check_against_hf(model_dir, work, run_concurrently(stack.spec.gateway_address, work))
        check_against_hf(model_dir, work, run_concurrently(stack.spec.gateway_address, work))
        stats = wait_until_idle(stack)
        decodes = [p for p in stats.pools if p.role == 2]
        drafted = sum(p.spec_decode_num_draft_tokens for p in decodes)
        accepted = sum(p.spec_decode_num_accepted_tokens for p in decodes)
        assert drafted >= accepted > 0
        if num_draft_layers is None:  # the target drafting for itself: nearly all accepted
            assert accepted >= 0.9 * drafted
        assert sum(p.preemptions for p in decodes) > 0
        if preemption == "swap":
            assert sum(p.swap_outs for p in decodes) > 0
        assert all(p.num_free_blocks == p.num_blocks for p in stats.pools)

        # A decode worker killed mid-generation: its requests finish exactly elsewhere.
        prompts = [tokenizer.encode(p) for p in SAMPLE_PROMPTS[:4]]
        streams = [
            BackgroundStream(stack.spec.gateway_address, greedy_request(p, 48), 120)
            for p in prompts
        ]
        for stream in streams:
            stream.wait_tokens(2)
        by_name = {p.worker_id: p for p in pool_stats(stack).pools}
        victim = max(
            (p.name for p in stack.processes if p.name.startswith("decode-")),
            key=lambda n: by_name[n].num_requests,
        )
        stack.signal(victim, signal.SIGKILL)
        stack.wait_exit(victim)
        for prompt, stream in zip(prompts, streams, strict=True):
            stream.result()
            assert stream.code == grpc.StatusCode.OK, stream.details
            assert stream.token_ids == hf_greedy(model_dir, prompt, 48)
        assert pool_stats(stack).restarted_requests > 0
        stats = wait_until_idle(stack, skip=(victim,))
        assert all(p.num_free_blocks == p.num_blocks for p in stats.pools if p.healthy)
    finally:
        stack.stop()
