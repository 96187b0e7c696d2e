"""gpt-oss served end to end, checked against HF `generate` (fp32 greedy): a tiny checkpoint
with its experts in MXFP4 (as the published ones; `devtools.mxfp4_checkpoint`), sliding /
full / sliding layers with a window of 12 (shorter than a KV block, the step budget and
every prompt here), attention sinks, YaRN RoPE. One disaggregated stack: a prefill worker
and a decode worker of two ranks with expert parallelism (attention heads split, two of the
four experts whole on each rank, both dequantized from MXFP4 at load) under a 16-token step
budget, so prompts are prefilled in chunks attending to earlier chunks through the cache,
their KV moves to the decode worker, concurrent requests share steps, a repeated prompt hits
the prefix cache; every output equals HF's (HF dequantizing the same MXFP4 folder). And a
worker given a gpt-oss checkpoint with a setting Tandem does not compute exits with one line
naming it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from devtools.checkpoint_builder import build_checkpoint
from devtools.mxfp4_checkpoint import quantize_checkpoint_experts
from services.stack.launcher import ROOT
from tests.hf_reference import hf_greedy
from tests.service.test_e2e import run_concurrently
from tests.service.test_e2e_tensor_parallel import peer_ranks
from tests.stack_client import generate, greedy_request, wait_until_idle

WINDOW = 12
BUDGET = 16  # prompt tokens per step
DECODE = 2  # WorkerRole
YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "truncate": False,
}


def mxfp4_checkpoint(tmp_path_factory):
    """The tiny gpt-oss checkpoint with MXFP4 experts (module docstring)."""
    plain = build_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "gpt-oss", "gpt_oss", num_hidden_layers=3,
        intermediate_size=64, sliding_window=WINDOW, rope_scaling=YARN, seed=43,
    )  # fmt: skip
    folder = tmp_path_factory.mktemp("ckpt") / "gpt-oss-mxfp4"
    shutil.copytree(plain, folder)
    return quantize_checkpoint_experts(folder)


@pytest.fixture(scope="module")
def served(module_stacks, tmp_path_factory):
    """(MXFP4 checkpoint folder, stack) for the whole module."""
    folder = mxfp4_checkpoint(tmp_path_factory)
    stack = module_stacks(
        folder,
        name="gpt-oss",
        extra_args={
            "scheduler": ["--max-num-batched-tokens", str(BUDGET)],
            "decode": ["--tensor-parallel-size", "2", "--enable-expert-parallel"],
        },
    )
    return folder, stack


def prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (length,), generator=generator).tolist()


def test_chunked_prompts_past_the_window_equal_hf(served) -> None:
    folder, stack = served
    work = [(prompt(45, 1), 20), (prompt(20, 2), 24), (prompt(13, 3), 16)]
    decode_workers = [p.name for p in stack.processes if p.name.startswith("decode-")]
    assert [len(peer_ranks(stack, w)) for w in decode_workers] == [1]  # two ranks
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
    request.cache_salt = "gpt-oss-repeated"
    first = generate(stack.spec.gateway_address, request)
    again = generate(stack.spec.gateway_address, request)
    assert first.token_ids == again.token_ids == hf_greedy(folder, ids, 12)
    assert first.usage.cached_tokens == 0 and again.usage.cached_tokens == 32
    stats = wait_until_idle(stack)
    assert all(p.num_free_blocks == p.num_blocks for p in stats.pools)


@pytest.mark.parametrize(
    "fields, line",
    [
        ({"swiglu_limit": 0}, "gpt_oss swiglu_limit must be positive, got 0"),
        (
            {"quantization_config": {"quant_method": "bitsandbytes"}},
            "quantization_config.quant_method 'bitsandbytes' is not supported: Tandem loads "
            "compressed-tensors (float-quantized FP8) and gptq (4 or 8 bits) checkpoints",
        ),
    ],
    ids=["swiglu-limit", "quant-method"],
)
def test_worker_exits_naming_an_unsupported_gpt_oss_setting(fields, line, tmp_path) -> None:
    """The start stops on the config, before any weight is read: one stderr line."""
    raw = {
        "model_type": "gpt_oss",
        "vocab_size": 1024,
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
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
