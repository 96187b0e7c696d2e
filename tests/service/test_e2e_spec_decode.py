"""Speculative decoding (n-gram) end to end on the real services, checked against HF
`generate`: greedy output is HF's on Llama and Qwen2 through prefill and decode workers
with concurrency, chunked prompts, prefix hits and decode-side preemption; requests whose
output repeats itself (three tokens pushed up by logit_bias, HF's sequence_bias) get their
proposals accepted, several tokens per step; the counts reach GetPoolStats, the sample's
usage and the scheduler's log; every block comes back."""

from __future__ import annotations

import json

import pytest

from tests.hf_reference import hf_generate, hf_tokenizer
from tests.service.test_e2e import run_concurrently
from tests.service.test_e2e_scheduling import (
    SMALL_POOLS,
    check_against_hf,
    finished_lines,
    workload,
)
from tests.stack_client import generate, greedy_request, start_stack, wait_until_idle

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
