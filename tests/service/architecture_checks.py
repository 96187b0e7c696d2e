"""Checks every architecture's services test runs the same way, on a disaggregated stack
(one prefill worker, one decode worker) with a small step budget:
- `chunked_prompts_equal_hf`: three concurrent prompts (45, 20 and 13 tokens: past a short
  window, several chunks) equal HF's greedy output (not a degenerate one), their KV moved
  to the decode worker, and every block is back;
- `repeated_prompt_hits_the_prefix_cache`: a 40-token prompt twice, the second time 32
  tokens (two full 16-token blocks) cached, both HF's;
- `startup_error_lines`: a worker started on a bare `config.json` stops on the config,
  before any weight is read; the stderr lines naming the error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from services.stack.launcher import ROOT
from tests.hf_reference import hf_greedy
from tests.service.test_e2e import run_concurrently
from tests.stack_client import generate, greedy_request, wait_until_idle

PREFILL, DECODE = 1, 2  # WorkerRole


def prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 1000, (length,), generator=generator).tolist()


def chunked_prompts_equal_hf(folder: Path, stack, budget: int | None = None) -> None:
    """`budget`: the scheduler's step budget, to check the prompts ran in chunks."""
    work = [(prompt(45, 1), 20), (prompt(20, 2), 24), (prompt(13, 3), 16)]
    before = {p.worker_id: p for p in wait_until_idle(stack).pools}
    results = run_concurrently(stack.spec.gateway_address, work)
    for (ids, max_tokens), got in zip(work, results, strict=True):
        expected = hf_greedy(folder, ids, max_tokens)
        assert got.token_ids == expected, ids
        assert len(set(expected)) >= 4, f"degenerate reference {expected}"
    stats = wait_until_idle(stack)
    grew = {p.worker_id: p for p in stats.pools}
    moved = sum(
        p.kv_transfers - before[p.worker_id].kv_transfers for p in stats.pools if p.role == DECODE
    )
    assert moved >= len(work) - 1  # P/D: the prompts' KV went to the decode worker
    if budget is not None:
        steps = sum(
            grew[w].steps - p.steps for w, p in before.items() if p.role == PREFILL
        )  # fmt: skip
        assert steps >= -(-sum(len(ids) for ids, _ in work) // budget)  # chunked
    assert all(p.num_free_blocks == p.num_blocks for p in stats.pools)


def repeated_prompt_hits_the_prefix_cache(folder: Path, stack, salt: str) -> None:
    ids = prompt(40, 4)  # two full 16-token blocks and 8 tokens
    request = greedy_request(ids, 12)
    request.cache_salt = salt
    first = generate(stack.spec.gateway_address, request)
    again = generate(stack.spec.gateway_address, request)
    assert first.token_ids == again.token_ids == hf_greedy(folder, ids, 12)
    assert first.usage.cached_tokens == 0 and again.usage.cached_tokens == 32
    stats = wait_until_idle(stack)
    assert all(p.num_free_blocks == p.num_blocks for p in stats.pools)


def startup_error_lines(config: dict, folder: Path) -> list[str]:
    """`python -m services.worker` on a folder holding only `config`: it must exit with
    status 2; the stderr lines that name a startup error."""
    (folder / "config.json").write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "services.worker", "--model", str(folder),
            "--host", "127.0.0.1", "--port", "0", "--device", "cpu"]  # fmt: skip
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    return [line for line in done.stderr.splitlines() if "startup error" in line]
