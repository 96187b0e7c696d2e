"""Retention hints end to end (issue 45, `kv_retention_s`): a conversation that asked for
its KV to be kept survives a flood of other requests that evicts a conversation that did
not ask (its next turn is served from the prefix cache: cached tokens and the pool's hit
counter; its output HF-exact), and once its retention has expired it is evicted like any
other; a value over --max-kv-retention-s is INVALID_ARGUMENT naming field and limit. A beam
search that asked keeps its prompt and its best hypothesis the same way (its hypotheses
equal to transformers' beam search, the next turn's output to its greedy decoding). No
block is left held in the device pool or the host tier.

Expiry is certain, not timed: the scheduler sets a deadline of (finish + retention)
before the response leaves, so once the test's clock (same host, same wall clock) has
passed (response received + retention), the deadline has passed too."""

from __future__ import annotations

import time

import grpc
import pytest

from tests.hf_reference import hf_beam_search, hf_greedy, hf_model
from tests.service.test_e2e_beam_search import beam_request, run_beam
from tests.stack_client import generate, greedy_request, pool_stats, start_stack, wait_until_idle

BLOCK = 16


def turn(prompt: list[int], max_tokens: int, retention: float | None = None):
    request = greedy_request(prompt, max_tokens)
    request.cache_salt = "retention"
    if retention is not None:
        request.kv_retention_s = retention
    return request


def retention_stack(model, run_dir, num_blocks: int):
    """One `both` worker: `num_blocks` blocks of 16 tokens, a host tier of 8 blocks, and
    retention allowed up to 600 s."""
    args = {
        "both": [
            *("--max-model-len", "160", "--num-blocks", str(num_blocks)),
            *("--block-size", str(BLOCK)),
            *("--kv-offload-cpu-bytes", str(8 * 2 * 2 * BLOCK * 2 * 16 * 4)),
        ],
        "scheduler": ["--max-kv-retention-s", "600"],
    }
    return start_stack(model, run_dir, prefill=0, decode=0, both=1, extra_args=args)


def exact_turns(model, address):
    """`exact(prompt, max_tokens, retention=None)`: a salted greedy turn on the stack at
    `address`, its output checked against HF."""

    def exact(prompt: list[int], max_tokens: int, retention=None):
        answer = generate(address, turn(prompt, max_tokens, retention))
        assert answer.token_ids == hf_greedy(model, prompt, max_tokens)
        return answer

    return exact


def device_hits(stack) -> int:
    (pool,) = wait_until_idle(stack).pools
    return pool.prefix_hit_tokens


def test_a_retained_conversation_survives_a_flood_and_expires_after_its_time(
    tiny_llama_dir, tmp_path
):
    # 10 blocks of 16 tokens: a conversation's 4 blocks and one flood request's 4 fit
    # together, two conversations and a flood request do not. A host tier of 8 blocks.
    stack = retention_stack(tiny_llama_dir, tmp_path / "run", 10)
    address = stack.spec.gateway_address

    exact = exact_turns(tiny_llama_dir, address)

    def flood(first: int) -> None:
        for start in range(first, first + 3 * 100, 100):  # 3 requests of 4 blocks each
            exact(list(range(start, start + 60)), 4)

    try:
        with pytest.raises(grpc.RpcError) as refused:
            generate(address, turn(list(range(5, 20)), 2, retention=601.0))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "kv_retention_s must be <= 600" in refused.value.details()

        kept_prompt = list(range(5, 69))  # 4 full blocks
        kept = exact(kept_prompt, 8, retention=600.0)
        plain_prompt = list(range(205, 269))
        plain = exact(plain_prompt, 8)
        flood(600)
        before = device_hits(stack)
        second = kept_prompt + list(kept.token_ids) + list(range(80, 88))
        kept2 = exact(second, 8, retention=600.0)
        assert kept2.usage.cached_tokens == 4 * BLOCK  # the retained prefix, on the device
        assert device_hits(stack) - before == 4 * BLOCK
        again = exact(plain_prompt + list(plain.token_ids) + list(range(80, 88)), 8)
        assert again.usage.cached_tokens == 0  # the flood evicted it, in both tiers

        # A conversation retained for 1 s, past its deadline, is an ordinary LRU one.
        brief_prompt = list(range(405, 469))
        brief = exact(brief_prompt, 8, retention=1.0)
        answered = time.time()
        while time.time() <= answered + 1.0:  # its deadline is before this bound
            time.sleep(answered + 1.0 - time.time() + 0.01)
        flood(610)
        late = exact(brief_prompt + list(brief.token_ids) + list(range(80, 88)), 8)
        assert late.usage.cached_tokens == 0
        # The first conversation's later turn (retained for 600 s) is still there.
        third = second + list(kept2.token_ids) + list(range(90, 94))
        assert exact(third, 8, retention=600.0).usage.cached_tokens == 5 * BLOCK

        (pool,) = wait_until_idle(stack).pools
        assert pool.num_free_blocks == pool.num_blocks  # nothing leaked
        pool_stats(stack)  # (asserts the integrity of the pool and its host tier: no block held)
    finally:
        stack.stop()


def test_a_retained_prompt_stays_in_the_prefill_pool_after_its_hand_off(tiny_llama_dir, tmp_path):
    """Disaggregated: the request finishes on the decode worker, but its prompt's blocks
    leave the prefill pool at the hand-off, retained there too; the next turn's prompt
    is a prefix hit on the prefill worker although a flood came between."""
    pool = ["--max-model-len", "160", "--num-blocks", "10", "--block-size", str(BLOCK)]
    args = {"prefill": pool, "decode": pool, "scheduler": ["--max-kv-retention-s", "600"]}
    stack = start_stack(tiny_llama_dir, tmp_path / "run", prefill=1, decode=1, extra_args=args)
    exact = exact_turns(tiny_llama_dir, stack.spec.gateway_address)

    try:
        kept_prompt, plain_prompt = list(range(5, 69)), list(range(205, 269))  # 4 blocks
        kept = exact(kept_prompt, 8, retention=600.0)
        plain = exact(plain_prompt, 8)
        for start in range(600, 900, 100):  # evicts what nothing retains
            exact(list(range(start, start + 60)), 4)
        second = exact(kept_prompt + list(kept.token_ids) + list(range(80, 88)), 8)
        assert second.usage.cached_tokens == 4 * BLOCK  # on the prefill worker
        again = exact(plain_prompt + list(plain.token_ids) + list(range(80, 88)), 8)
        assert again.usage.cached_tokens == 0
        pools = wait_until_idle(stack).pools
        assert all(p.num_free_blocks == p.num_blocks for p in pools)  # nothing leaked
    finally:
        stack.stop()


def test_a_retained_beam_search_keeps_its_prompt_and_best_hypothesis_past_a_flood(
    tiny_llama_dir, tmp_path
):
    """A beam search (width 2) over a 56-token prompt asks for retention: its blocks are
    the prompt's 3 full ones and a 4th holding 8 of the best hypothesis's tokens. A flood
    that evicts an unretained conversation from both tiers leaves them: the next turn,
    continuing the best hypothesis, is a 4-block device prefix hit."""
    stack = retention_stack(tiny_llama_dir, tmp_path / "run", 14)
    address = stack.spec.gateway_address
    exact = exact_turns(tiny_llama_dir, address)

    try:
        prompt = list(range(5, 61))  # 3 full blocks and 8 tokens
        search = beam_request(prompt, 2, 1.0, False, 1)
        search.max_tokens = 12
        search.cache_salt = "retention"
        search.kv_retention_s = 600.0
        got = run_beam(address, search)[0]["tokens"]
        eos = [hf_model(str(tiny_llama_dir)).generation_config.eos_token_id]
        ((best, _),) = hf_beam_search(
            tiny_llama_dir, prompt, num_beams=2, max_new_tokens=12, eos_token_ids=eos
        )
        assert got == best and len(best) >= 9  # the 4th block is the hypothesis's too
        plain_prompt = list(range(205, 269))
        plain = exact(plain_prompt, 8)
        for start in range(600, 1000, 100):  # 4 requests of 4 blocks: a pool turns over
            exact(list(range(start, start + 60)), 4)
        before = device_hits(stack)
        follow_up = prompt + best + list(range(80, 88))
        answer = exact(follow_up, 8)
        assert answer.usage.cached_tokens == 4 * BLOCK  # prompt + best hypothesis, kept
        assert device_hits(stack) - before == 4 * BLOCK
        again = exact(plain_prompt + list(plain.token_ids) + list(range(80, 88)), 8)
        assert again.usage.cached_tokens == 0  # the flood evicted it, in both tiers
        (pool,) = wait_until_idle(stack).pools
        assert pool.num_free_blocks == pool.num_blocks  # nothing leaked
        pool_stats(stack)  # (asserts the integrity of the pool and its host tier)
    finally:
        stack.stop()
