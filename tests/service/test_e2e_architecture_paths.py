"""The architectures issue 43 added (Mixtral and Qwen3-MoE experts, a windowed Mistral whose
40-token window is shorter than every prompt here: its requests hold the blocks of the
window and one more, the rest are trimmed; Gemma 2 and Gemma 3 with sliding and full
layers; gpt-oss with MXFP4 experts, sinks, sliding and full layers) through the scheduling
paths that move or rebuild a request's KV, each checked against HF `generate` token for
token:
- recompute preemption: the workload of `test_e2e_scheduling` queued together on small
  pools (its docstring: why it must preempt), one prefill and two decode workers;
- a decode worker SIGKILLed while it holds requests (`kill_busiest` freezes the decode
  workers first, so it surely does): they finish on the other, recomputed;
- swap preemption: the same workload on a stack whose scheduler swaps instead.
After each, every pool is all free.
"""

from __future__ import annotations

import pytest

from common.model_config import ModelConfig
from devtools.checkpoint_builder import build_checkpoint
from tests.fault_injection import assert_all_alive_but, kill_busiest, wait_healthy_pools
from tests.hf_reference import hf_greedy, hf_tokenizer
from tests.service.test_e2e import run_concurrently
from tests.service.test_e2e_gemma import CHECKPOINTS as GEMMA_CHECKPOINTS
from tests.service.test_e2e_gemma import WINDOW as GEMMA_WINDOW
from tests.service.test_e2e_gpt_oss import mxfp4_checkpoint
from tests.service.test_e2e_scheduling import check_against_hf, workload
from tests.service.test_faults import HEALTH_FLAGS
from tests.stack_client import (
    SAMPLE_PROMPTS,
    SMALL_POOLS,
    BackgroundStream,
    greedy_request,
    pool_stats,
    wait_until_idle,
)

DECODE = 2  # WorkerRole
# Shorter than every prompt of the workload (51-62 tokens), so its blocks are trimmed, yet
# over two blocks: a request holds up to 4 of the decode pool's 9, and the workload still
# preempts (7 requests at once).
WINDOW = 40
# Long enough that no stream ends between its 2nd token and the decode workers' freeze
# (`kill_busiest`); short enough for max_model_len 96 with the longest sample prompt.
LONG_OUTPUT = 64  # the longest sample prompt is 28 tokens here


@pytest.fixture(scope="module")
def tiny_windowed_mistral_dir(tmp_path_factory):
    return build_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "mistral-window", "mistral", sliding_window=WINDOW
    )


@pytest.fixture(scope="module")
def tiny_gemma2_dir(tmp_path_factory):
    return gemma_checkpoint(tmp_path_factory, "gemma2")


@pytest.fixture(scope="module")
def tiny_gemma3_text_dir(tmp_path_factory):
    return gemma_checkpoint(tmp_path_factory, "gemma3_text")


@pytest.fixture(scope="module")
def tiny_gpt_oss_dir(tmp_path_factory):
    return mxfp4_checkpoint(tmp_path_factory)  # test_e2e_gpt_oss's


def gemma_checkpoint(tmp_path_factory, architecture: str):
    """`test_e2e_gemma`'s checkpoint: sliding / full / sliding layers (window 12)."""
    return build_checkpoint(
        tmp_path_factory.mktemp("ckpt") / architecture,
        architecture,
        num_hidden_layers=3,
        sliding_window=GEMMA_WINDOW,
        **GEMMA_CHECKPOINTS[architecture],
    )


@pytest.fixture(
    scope="module",
    params=["mixtral", "qwen3_moe", "windowed_mistral", "gemma2", "gemma3_text", "gpt_oss"],
)
def folder(request):
    return request.getfixturevalue(f"tiny_{request.param}_dir")


def start(module_stacks, folder, preemption: str, decode: int):
    scheduler = [*SMALL_POOLS["scheduler"], *HEALTH_FLAGS, "--preemption-mode", preemption]
    pools = small_pools(folder)
    return module_stacks(
        folder,
        name=f"{folder.name}-{preemption}",
        prefill=1,
        decode=decode,
        extra_args={**pools, "scheduler": scheduler},
    )


def small_pools(folder) -> dict[str, list[str]]:
    """`SMALL_POOLS`, in the same bytes for a model with several KV groups (whose blocks
    hold one group's layers each: `common.kv_groups`)."""
    groups = ModelConfig.from_folder(folder).kv_groups().num_groups
    pools = {}
    for role, args in SMALL_POOLS.items():
        args = list(args)
        if "--num-blocks" in args:
            at = args.index("--num-blocks") + 1
            args[at] = str(int(args[at]) * groups)
        pools[role] = args
    return pools


def preempted_workload_is_exact(stack, folder) -> None:
    before = {p.worker_id: p for p in pool_stats(stack).pools}
    work = workload(hf_tokenizer(str(folder)))
    results = run_concurrently(stack.spec.gateway_address, work, held=stack)
    check_against_hf(folder, work, results)
    stats = wait_until_idle(stack)
    grew = [p.preemptions - before[p.worker_id].preemptions for p in stats.pools]
    assert sum(grew) > 0, "small pools must preempt"
    assert all(p.num_free_blocks == p.num_blocks for p in stats.pools)
    return stats, before


def test_recompute_preemption_and_a_killed_decode_worker(module_stacks, folder) -> None:
    stack = start(module_stacks, folder, "recompute", decode=2)
    preempted_workload_is_exact(stack, folder)

    tokenizer = hf_tokenizer(str(folder))
    streams = [
        BackgroundStream(stack.spec.gateway_address, greedy_request(p, LONG_OUTPUT), 120.0)
        for p in SAMPLE_PROMPTS
    ]
    for stream in streams:
        stream.wait_tokens(2)
    failures = pool_stats(stack).worker_failures
    victim = kill_busiest(stack, "decode")
    for prompt, stream in zip(SAMPLE_PROMPTS, streams, strict=True):
        stream.result()
        want = hf_greedy(folder, tokenizer.encode(prompt), LONG_OUTPUT)
        assert stream.token_ids == want, (prompt, stream.code, stream.details)
    assert pool_stats(stack).worker_failures == failures + 1
    wait_until_idle(stack, skip=(victim,))
    assert_all_alive_but(stack, victim)
    stack.restart_all([victim])
    wait_healthy_pools(stack)
    wait_until_idle(stack)


def test_swap_preemption(module_stacks, folder) -> None:
    stack = start(module_stacks, folder, "swap", decode=1)
    stats, before = preempted_workload_is_exact(stack, folder)
    decode = next(p for p in stats.pools if p.role == DECODE)
    assert decode.swap_outs > before[decode.worker_id].swap_outs
    assert decode.num_free_swap_blocks == decode.num_swap_blocks > 0
