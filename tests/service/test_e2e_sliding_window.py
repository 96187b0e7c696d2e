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
import torch

from devtools.checkpoint_builder import build_checkpoint
from tests.hf_reference import hf_greedy
from tests.service.test_e2e import run_concurrently
from tests.stack_client import (
    BackgroundStream,
    frozen,
    generate,
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


def prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (length,), generator=generator).tolist()


def test_chunked_prompts_past_the_window_equal_hf(served) -> None:
    folder, stack = served
    work = [(prompt(45, 1), 20), (prompt(20, 2), 24), (prompt(13, 3), 16)]
    before = {p.worker_id: p for p in wait_until_idle(stack).pools}
    results = run_concurrently(stack.spec.gateway_address, work)
    for (ids, max_tokens), got in zip(work, results, strict=True):
        assert got.token_ids == hf_greedy(folder, ids, max_tokens), ids
    stats = wait_until_idle(stack)
    moved = sum(
        p.kv_transfers - before[p.worker_id].kv_transfers for p in stats.pools if p.role == DECODE
    )
    assert moved >= len(work) - 1  # P/D: the prompts' KV went to the decode worker
    assert all(p.num_free_blocks == p.num_blocks for p in stats.pools)


def test_repeated_prompt_hits_the_prefix_cache(served) -> None:
    folder, stack = served
    ids = prompt(40, 4)  # two full 16-token blocks and 8 tokens
    request = greedy_request(ids, 12)
    request.cache_salt = "sliding-window-repeated"
    first = generate(stack.spec.gateway_address, request)
    again = generate(stack.spec.gateway_address, request)
    assert first.token_ids == again.token_ids == hf_greedy(folder, ids, 12)
    assert first.usage.cached_tokens == 0 and again.usage.cached_tokens == 32
    stats = wait_until_idle(stack)
    assert all(p.num_free_blocks == p.num_blocks for p in stats.pools)


def test_a_long_request_holds_only_the_blocks_of_its_window(served) -> None:
    """Mid-stream, with the decode worker frozen (so the request surely holds its blocks
    there), the scheduler's decode pool lends the request at most 2 blocks: its window (12
    tokens) spans at most 2 blocks of 16 while its context (96 + tokens so far) spans 7.
    The blocks before the window were freed; the output is still HF's."""
    folder, stack = served
    ids = prompt(8 * WINDOW, 5)
    stream = BackgroundStream(stack.spec.gateway_address, greedy_request(ids, 40), 120.0)
    stream.wait_tokens(8)
    decode_worker = next(p.name for p in stack.processes if p.name.startswith("decode-"))
    with frozen(stack, [decode_worker]):
        pool = next(p for p in pool_stats(stack).pools if p.role == DECODE)
        held = pool.num_blocks - pool.num_free_blocks
        assert pool.num_requests == 1 and 1 <= held <= 2, (held, pool)
    stream.result()
    assert stream.token_ids == hf_greedy(folder, ids, 40)
    stats = wait_until_idle(stack)
    assert all(p.num_free_blocks == p.num_blocks for p in stats.pools)
