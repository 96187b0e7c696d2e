"""RoPE scaling served end to end: tiny llamas with dynamic and longrope RoPE (whose
rotations depend on each request's prompt length and position, `models/rope.py`) and yarn,
each behind one disaggregated stack (1 prefill + 1 decode worker, a step budget of 16 so
every prompt here is chunked), greedy output equal to HF `generate` for prompts that start
past the original context (32 tokens) or cross it while generating.

The prefix cache keys a prompt's blocks on the RoPE state its KV was computed under
(`common.rope_config.prompt_rope_key`): the same prompt twice hits; a prompt sharing
blocks with one of a different state does not (dynamic: any other length past 32;
longrope: the other side of 32), and still equals HF.
"""

from __future__ import annotations

import pytest
import torch

from devtools.checkpoint_builder import build_checkpoint
from tests.hf_reference import hf_greedy
from tests.stack_client import generate, greedy_request, start_stack, wait_until_idle

ORIGINAL = 32  # the context the RoPE was "trained" for
BUDGET = 16  # prompt tokens per step
BLOCK = 16
HALF = 8  # head_dim 16 (hidden 64, 4 heads) has 8 frequencies
ROPES = {
    # dynamic grows past max_position_embeddings itself: 32, served up to 32 x 4
    "dynamic": (ORIGINAL, {"rope_type": "dynamic", "factor": 4.0}),
    "longrope": (
        128,
        {
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.1 * i for i in range(HALF)],
            "long_factor": [1.0 + 2.0 * i for i in range(HALF)],
            "original_max_position_embeddings": ORIGINAL,
        },
    ),
    "yarn": (
        128,
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    ),
}


@pytest.fixture(scope="module", params=list(ROPES))
def served(request, tmp_path_factory):
    """(rope type, checkpoint folder, stack): one stack per type, stopped before the next."""
    max_positions, rope = ROPES[request.param]
    folder = build_checkpoint(
        tmp_path_factory.mktemp("ckpt") / request.param,
        max_position_embeddings=max_positions,
        rope_scaling=rope,
        seed=5,
    )
    stack = start_stack(
        folder,
        tmp_path_factory.mktemp(f"rope-{request.param}"),
        prefill=1,
        decode=1,
        extra_args={"scheduler": ["--max-num-batched-tokens", str(BUDGET)]},
    )
    yield request.param, folder, stack
    stack.stop()


def prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (length,), generator=generator).tolist()


def run(stack, ids: list[int], max_tokens: int, salt: str):
    request = greedy_request(ids, max_tokens)
    request.cache_salt = salt
    got = generate(stack.spec.gateway_address, request)
    wait_until_idle(stack)
    return got


def test_prompts_past_and_across_the_original_context_equal_hf(served) -> None:
    """A 45-token prompt (3 chunks, past 32 from the start) and a 20-token one that
    generates across 32, sent together-ish one after the other."""
    rope_type, folder, stack = served
    for ids, max_tokens in [(prompt(45, 1), 20), (prompt(20, 2), 30)]:
        want = hf_greedy(folder, ids, max_tokens)
        got = run(stack, ids, max_tokens, f"{rope_type}-plain")
        assert got.token_ids == want, (rope_type, len(ids))
        assert got.usage.cached_tokens == 0
    assert len(want) > ORIGINAL - 20, "the short prompt's output must cross the original context"


def test_prefix_cache_hits_only_under_the_same_rope_state(served) -> None:
    """The same 45-token prompt twice: the second reuses its first 2 blocks. Then a
    40-token prompt sharing those 2 blocks (a hit only where its RoPE state is the first
    prompt's: longrope and yarn; dynamic rotates it as of 40, not 45), and a 24-token one
    sharing its first block (below 32: a hit for yarn only). Every output equals HF."""
    rope_type, folder, stack = served
    salt = f"{rope_type}-prefix"
    first = prompt(45, 3)
    shares = {
        "same": (first, 2 * BLOCK),
        "shorter, past 32": (first[:38] + prompt(2, 4), {"dynamic": 0}.get(rope_type, 2 * BLOCK)),
        "below 32": (first[:20] + prompt(4, 5), BLOCK if rope_type == "yarn" else 0),
    }
    want_first = hf_greedy(folder, first, 12)
    assert run(stack, first, 12, salt).token_ids == want_first
    for name, (ids, cached) in shares.items():
        got = run(stack, ids, 12, salt)
        assert got.token_ids == hf_greedy(folder, ids, 12), (rope_type, name)
        assert got.usage.cached_tokens == cached, (rope_type, name)
