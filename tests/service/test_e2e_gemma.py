"""Gemma 3 text and Gemma 2 served end to end, checked against HF `generate` (fp32 greedy): one
disaggregated stack per architecture (a prefill worker and a decode worker of two tensor-parallel
ranks) with a 16-token step budget. Tiny checkpoints with sliding / full / sliding layers and a
window of 12 (shorter than a KV block, the step budget and every prompt here): Gemma 3 with its
local RoPE on the sliding layers and linear-scaled global RoPE on the full one, q/k norms; Gemma 2
with soft-caps small enough to bend its attention scores and logits. Prompts are prefilled in chunks
attending to earlier chunks through the cache, their KV moves to the decode worker, concurrent
requests share steps, a repeated prompt hits the prefix cache; every output equals HF's. And a
worker given a Gemma checkpoint with a feature Tandem does not compute exits with one line naming
it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from common.model_config import SUPPORTED_ARCHITECTURES
from devtools.checkpoint_builder import build_checkpoint
from services.stack.launcher import ROOT
from tests.hf_reference import hf_greedy
from tests.service.test_e2e import run_concurrently
from tests.stack_client import generate, greedy_request, wait_until_idle

WINDOW = 12
BUDGET = 16  # prompt tokens per step
DECODE = 2  # WorkerRole
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
CHECKPOINTS = {
    "gemma3_text": {
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "config_overrides": {"layer_types": LAYER_TYPES},
        "seed": 31,
    },
    "gemma2": {
        "config_overrides": {
            "layer_types": LAYER_TYPES,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 5.0,
            "query_pre_attn_scalar": 16,
        },
        "seed": 32,
    },
}


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def served(request, module_stacks, tmp_path_factory):
    """(checkpoint folder, stack): one per architecture, for the whole module."""
    folder = build_checkpoint(
        tmp_path_factory.mktemp("ckpt") / request.param,
        request.param,
        num_hidden_layers=3,
        sliding_window=WINDOW,
        **CHECKPOINTS[request.param],
    )
    stack = module_stacks(
        folder,
        name=request.param,
        extra_args={
            "scheduler": ["--max-num-batched-tokens", str(BUDGET)],
            "decode": ["--tensor-parallel-size", "2"],  # KV moves into another layout
        },
    )
    return folder, stack


def prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (length,), generator=generator).tolist()


def test_chunked_prompts_past_the_window_equal_hf(served) -> None:
    folder, stack = served
    work = [(prompt(45, 1), 20), (prompt(20, 2), 24), (prompt(13, 3), 16)]
    before = {p.worker_id: p for p in wait_until_idle(stack).pools}
    results = run_concurrently(stack.spec.gateway_address, work)
    for (ids, max_tokens), got in zip(work, results, strict=True):
        expected = hf_greedy(folder, ids, max_tokens)
        assert got.token_ids == expected, ids
        assert len(set(expected)) >= 4, f"degenerate reference {expected}"
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
    request.cache_salt = "gemma-repeated"
    first = generate(stack.spec.gateway_address, request)
    again = generate(stack.spec.gateway_address, request)
    assert first.token_ids == again.token_ids == hf_greedy(folder, ids, 12)
    assert first.usage.cached_tokens == 0 and again.usage.cached_tokens == 32
    stats = wait_until_idle(stack)
    assert all(p.num_free_blocks == p.num_blocks for p in stats.pools)


@pytest.mark.parametrize(
    "fields, line",
    [
        (
            {"model_type": "gemma3_text", "use_bidirectional_attention": True},
            "gemma3_text with use_bidirectional_attention=true is not supported "
            "(causal attention only)",
        ),
        (
            {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]},
            f"unsupported model_type 'gemma3'; supported: {', '.join(SUPPORTED_ARCHITECTURES)}",
        ),
    ],
    ids=["bidirectional", "multimodal"],
)
def test_worker_exits_naming_an_unsupported_gemma_feature(fields, line, tmp_path) -> None:
    """The start stops on the config, before any weight is read: one stderr line."""
    raw = {
        "model_type": "gemma3_text",
        "vocab_size": 1024,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        **fields,
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "services.worker", "--model", str(tmp_path),
            "--host", "127.0.0.1", "--port", "0", "--device", "cpu"]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = [text for text in done.stderr.splitlines() if "startup error" in text]
    assert lines == [f"python -m services.worker: startup error: {line}"], done.stderr
