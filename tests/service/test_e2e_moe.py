"""Mixture-of-experts models (Mixtral, Qwen3-MoE) through the real services, checked against
HF `generate`: one disaggregated stack per architecture, each worker of two ranks, one with
tensor-parallel experts (each expert's inner dimension split) and the other expert-parallel
(half the experts whole on each rank): Mixtral prefills expert-parallel and decodes
tensor-parallel, Qwen3-MoE the other way round. A 16-token step budget, so every longer
prompt is computed in chunks whose KV then moves to the decode worker's ranks (DeepSeek's
UCX stack checks a MoE model's KV into another layout); concurrent requests share steps
(experts see batches of several tokens, some experts none), a repeated prompt hits the
prefix cache. And a worker given a checkpoint
whose experts Tandem does not compute exits with one line naming the field.
"""

from __future__ import annotations

import json

import pytest

from tests.hf_reference import hf_greedy, hf_tokenizer
from tests.service.architecture_checks import startup_error_lines
from tests.service.test_e2e import run_concurrently
from tests.service.test_e2e_tensor_parallel import peer_ranks
from tests.stack_client import generate, greedy_request, wait_until_idle

STEP_BUDGET = 16
PREFILL, DECODE = 1, 2  # WorkerRole
PROMPTS = [
    ("Once upon a time", 20),
    (
        "Paged attention stores keys and values in fixed-size blocks, and a block table maps "
        "each sequence's logical positions to physical blocks anywhere in the pool.",
        24,
    ),
    ("KV blocks move between workers while the decode worker keeps generating", 16),
    ("naïve café 中文字符 🚀", 12),
]


TP = ["--tensor-parallel-size", "2"]
EP = [*TP, "--enable-expert-parallel"]
PREFILL_RANKS = {"mixtral": EP, "qwen3_moe": TP}
DECODE_RANKS = {"mixtral": TP, "qwen3_moe": EP}


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def moe_stack(request, module_stacks):
    """(checkpoint folder, its stack): one stack per architecture, for the whole module."""
    folder = request.getfixturevalue(f"tiny_{request.param}_dir")
    model = ["--max-model-len", "96"]
    stack = module_stacks(
        folder,
        name=request.param,
        extra_args={
            "prefill": model + PREFILL_RANKS[request.param],
            "decode": model + DECODE_RANKS[request.param],
            "scheduler": ["--max-num-batched-tokens", str(STEP_BUDGET)],
        },
    )
    return folder, stack


def test_concurrent_chunked_prompts_equal_hf_greedy(moe_stack) -> None:
    folder, stack = moe_stack
    tokenizer = hf_tokenizer(str(folder))
    work = [(tokenizer.encode(text), max_tokens) for text, max_tokens in PROMPTS]
    assert max(len(p) for p, _ in work) > 2 * STEP_BUDGET  # chunked in 3 steps or more
    workers = [p.name for p in stack.processes if p.name.startswith(("prefill-", "decode-"))]
    assert [len(peer_ranks(stack, w)) for w in workers] == [1, 1]  # two ranks each
    before = {p.worker_id: p for p in wait_until_idle(stack).pools}
    results = run_concurrently(stack.spec.gateway_address, work)
    for (prompt, max_tokens), got in zip(work, results, strict=True):
        assert got.token_ids == hf_greedy(folder, prompt, max_tokens), prompt
    stats = wait_until_idle(stack)
    grew = {p.worker_id: p.kv_transfers - before[p.worker_id].kv_transfers for p in stats.pools}
    decode = [p.worker_id for p in stats.pools if p.role == DECODE]
    assert sum(grew[w] for w in decode) >= len(work) - 1  # P/D: prompts' KV moved over
    prompt_tokens = sum(len(p) for p, _ in work)
    prefill_steps = sum(
        p.steps - before[p.worker_id].steps for p in stats.pools if p.role == PREFILL
    )
    assert prefill_steps >= -(-prompt_tokens // STEP_BUDGET)
    assert all(p.num_free_blocks == p.num_blocks for p in stats.pools)


def test_repeated_prompt_hits_the_prefix_cache(moe_stack) -> None:
    folder, stack = moe_stack
    prompt = list(range(5, 45))  # two full 16-token blocks and 8 tokens
    request = greedy_request(prompt, 10)
    request.cache_salt = "moe-repeated"
    first = generate(stack.spec.gateway_address, request)
    again = generate(stack.spec.gateway_address, request)
    assert first.token_ids == again.token_ids == hf_greedy(folder, prompt, 10)
    assert first.usage.cached_tokens == 0 and again.usage.cached_tokens == 32
    wait_until_idle(stack)


def test_worker_exits_naming_an_unsupported_moe_field(tiny_qwen3_moe_dir, tmp_path) -> None:
    """The start stops on the config, before any weight is read: one stderr line."""
    raw = json.loads((tiny_qwen3_moe_dir / "config.json").read_text())
    raw["shared_expert_intermediate_size"] = 256  # qwen2_moe's shared expert
    lines = startup_error_lines(raw, tmp_path)
    assert lines == [
        "python -m services.worker: startup error: qwen3_moe with "
        "shared_expert_intermediate_size=256 is not supported (Tandem's experts are routed "
        "only: no shared or grouped experts)"
    ]
