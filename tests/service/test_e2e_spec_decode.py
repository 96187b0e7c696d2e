"""Speculative decoding end to end on the real services, checked against HF `generate`.

N-gram: greedy output is HF's on Llama, Qwen2, Qwen3-MoE and a windowed Mistral through
prefill and decode workers with concurrency, chunked prompts, prefix hits and decode-side
preemption; requests whose output repeats itself (three tokens pushed up by logit_bias,
HF's sequence_bias) get their proposals accepted, several tokens per step; the counts reach
GetPoolStats, the sample's usage and the scheduler's log; every block comes back.

Draft model (the target as its own draft on Llama; its first layer on Qwen2, with swap
preemption): the same, across two decode workers, one of them SIGKILLed with requests on it
(they recompute on the other, draft KV and all)."""

from __future__ import annotations

import json
import time

import grpc
import pytest

from devtools.checkpoint_builder import build_checkpoint
from tests.fault_injection import kill_busiest
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
    frozen,
    generate,
    greedy_request,
    pool_stats,
    start_stack,
    wait_until_idle,
    worker_names,
)

NGRAM = json.dumps(
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
)
# Every slot given: the scheduler's default gives them where they pay by measured step and
# draft costs, which would make whether these tests speculate at all a matter of timing.
ALL_SLOTS = ["--speculative-slots", "all"]
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


@pytest.fixture(scope="module")
def tiny_windowed_mistral_dir(tmp_path_factory):
    """Every layer windowed (40 tokens, shorter than the long prompts): trimmed tables."""
    return build_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "mistral-window", "mistral", sliding_window=40
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3_moe", "windowed_mistral"])
def test_ngram_speculation_is_hf_exact_and_accepts_repeating_output(arch, request, tmp_path):
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    pools = dict(SMALL_POOLS)
    pools["decode"] = [*SMALL_POOLS["decode"], "--speculative-config", NGRAM]
    pools["scheduler"] = [*SMALL_POOLS["scheduler"], *ALL_SLOTS]
    stack = start_stack(model_dir, tmp_path / "run", extra_args=pools)
    try:
        work = workload(hf_tokenizer(str(model_dir)))
        address = stack.spec.gateway_address
        check_against_hf(model_dir, work, run_concurrently(address, work, held=stack))
        # The same prompts again: prefix hits on both sides.
        check_against_hf(model_dir, work, run_concurrently(address, work, held=stack))
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
        # Queued together (`held`), all 7 reach the decode pool within a few prefill steps;
        # the 4 long ones alone arrive with 7 blocks (one shared 3-block prefix) and each
        # needs a 5th after 2-13 tokens and a 6th before its last: 15 in a pool of 10.
        assert decode.preemptions > 0
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
        "scheduler": [*SMALL_POOLS["scheduler"], "--preemption-mode", preemption, *ALL_SLOTS],
    }
    stack = start_stack(model_dir, tmp_path / "run", decode=2, extra_args=args)
    try:
        tokenizer = hf_tokenizer(str(model_dir))
        work = workload(tokenizer)
        address = stack.spec.gateway_address
        # Queued together (`held`): 24 blocks or more at the end (`workload`) in two decode
        # pools of 10; the long prompts go where their prefix is and outgrow that pool.
        check_against_hf(model_dir, work, run_concurrently(address, work, held=stack))
        check_against_hf(model_dir, work, run_concurrently(address, work, held=stack))
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

        # A decode worker killed with requests on it: they finish exactly elsewhere. Both
        # decode workers stay frozen until the 4 prompts (their first tokens streamed)
        # have their KV reserved in the decode pools; the one holding most (2 or more)
        # is killed then, so its requests certainly start over on the other, draft KV
        # and all, however fast they would otherwise have ended.
        prompts = [tokenizer.encode(p) for p in SAMPLE_PROMPTS[:4]]
        with frozen(stack, worker_names(stack, "decode")):
            streams = [
                BackgroundStream(stack.spec.gateway_address, greedy_request(p, 48), 120)
                for p in prompts
            ]
            for stream in streams:
                stream.wait_tokens(1)
            deadline = time.monotonic() + 10
            while sum(p.num_requests for p in pool_stats(stack).pools if p.role == 2) < 4:
                assert time.monotonic() < deadline, "the prompts did not reach the decode pools"
                time.sleep(0.01)
            victim = kill_busiest(stack, "decode")
        for prompt, stream in zip(prompts, streams, strict=True):
            stream.result()
            assert stream.code == grpc.StatusCode.OK, stream.details
            assert stream.token_ids == hf_greedy(model_dir, prompt, 48)
        assert pool_stats(stack).restarted_requests > 0
        stats = wait_until_idle(stack, skip=(victim,))
        assert all(p.num_free_blocks == p.num_blocks for p in stats.pools if p.healthy)
    finally:
        stack.stop()
