"""Sliding-window attention served end to end: a tiny Mistral whose window (12 tokens) is shorter
than a KV block (16), than the step budget (16) and than every prompt here, behind one disaggregated
stack (1 prefill worker + 1 decode worker of two tensor-parallel ranks). Prompts are prefilled in
chunks that attend to earlier chunks through the cache, their KV moves to the decode worker, and the
greedy output equals HF `generate` token for token; a repeated prompt hits the prefix cache and
still equals HF. A request at 8x the window holds two blocks of the decode pool (the window and
one), not the 7 its context spans. Every block is back in the pool afterwards.
"""

from __future__ import annotations

import pytest

from devtools.checkpoint_builder import build_checkpoint
from tests.hf_reference import hf_greedy
from tests.service.architecture_checks import (
    chunked_prompts_equal_hf,
    prompt,
    repeated_prompt_hits_the_prefix_cache,
)
from tests.stack_client import (
    BackgroundStream,
    frozen,
    greedy_request,
    pool_stats,
    start_stack,
    wait_until_idle,
)

WINDOW = 12
BUDGET = 16  # prompt tokens per step
DECODE = 2  # WorkerRole


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(checkpoint folder, stack) for the whole module."""
    folder = build_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "mistral-window", "mistral", sliding_window=WINDOW
    )
    stack = start_stack(
        folder,
        tmp_path_factory.mktemp("sliding-window"),
        prefill=1,
        decode=1,
        extra_args={
            "scheduler": ["--max-num-batched-tokens", str(BUDGET)],
            "decode": ["--tensor-parallel-size", "2"],  # KV moves into another layout
        },
    )
    yield folder, stack
    stack.stop()


def test_chunked_prompts_past_the_window_equal_hf(served) -> None:
    folder, stack = served
    chunked_prompts_equal_hf(folder, stack)


def test_repeated_prompt_hits_the_prefix_cache(served) -> None:
    folder, stack = served
    repeated_prompt_hits_the_prefix_cache(folder, stack, "sliding-window-repeated")


def test_a_long_request_holds_only_the_blocks_of_its_window(served) -> None:
    """Mid-stream, with the decode worker frozen (so the request surely holds its blocks
    there), the scheduler's decode pool lends the request at most 2 blocks: its window (12
    tokens) spans at most 2 blocks of 16 while its context (96 + tokens so far) spans 7.
    The blocks before the window were freed; the output is still HF's."""
    folder, stack = served
    ids = prompt(8 * WINDOW, 5)
    # 200 tokens: the freeze lands milliseconds after the 8th, with ~190 decode steps left
    stream = BackgroundStream(stack.spec.gateway_address, greedy_request(ids, 200), 120.0)
    stream.wait_tokens(8)
    decode_worker = next(p.name for p in stack.processes if p.name.startswith("decode-"))
    with frozen(stack, [decode_worker]):
        pool = next(p for p in pool_stats(stack).pools if p.role == DECODE)
        held = pool.num_blocks - pool.num_free_blocks
        assert pool.num_requests == 1 and 1 <= held <= 2, (held, pool)
    stream.result()
    assert stream.token_ids == hf_greedy(folder, ids, 200)
    stats = wait_until_idle(stack)
    assert all(p.num_free_blocks == p.num_blocks for p in stats.pools)
