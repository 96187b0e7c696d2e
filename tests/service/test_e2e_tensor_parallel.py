"""Tensor-parallel workers through the real services, checked against HF `generate`: a
both-role worker of 2 ranks (gloo, one process per rank, started by the worker itself) on
a GQA model with 2 KV heads and on one with 8, under concurrency, chunked prefill and
preemption by recompute and by swap; the pools end leak-free. A rank killed mid-stream
takes its whole worker down and the requests finish exactly on the other worker."""

from __future__ import annotations

import signal

import grpc
import psutil
import pytest

from devtools.checkpoint_builder import build_checkpoint
from tests.hf_reference import hf_greedy, hf_tokenizer
from tests.service.test_e2e import run_concurrently
from tests.service.test_e2e_scheduling import SMALL_POOLS, check_against_hf, workload
from tests.stack_client import (
    SAMPLE_PROMPTS,
    BackgroundStream,
    greedy_request,
    start_stack,
    wait_until_idle,
)

TP2 = ["--tensor-parallel-size", "2"]


@pytest.fixture(scope="module")
def eight_kv_heads_dir(tmp_path_factory):
    """A tiny Llama whose 8 query heads each have their own KV head (TP=2: 4 per rank)."""
    return build_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "llama-8kv",
        "llama",
        num_attention_heads=8,
        num_key_value_heads=8,
    )


def peer_ranks(stack, name: str) -> list[psutil.Process]:
    worker = psutil.Process(stack.process(name).pid)
    return [
        p for p in worker.children() if "services.worker.parallel.peer" in " ".join(p.cmdline())
    ]


@pytest.mark.parametrize(
    ("model", "preemption"),
    [("tiny_llama_dir", "recompute"), ("eight_kv_heads_dir", "swap")],
    ids=["2-kv-heads-recompute", "8-kv-heads-swap"],
)
def test_tp2_worker_is_hf_exact_with_chunking_and_preemption(model, preemption, request, tmp_path):
    folder = request.getfixturevalue(model)
    args = {
        "both": [*SMALL_POOLS["decode"], *TP2],
        "scheduler": [*SMALL_POOLS["scheduler"], "--preemption-mode", preemption],
    }
    stack = start_stack(folder, tmp_path / "run", prefill=0, decode=0, both=1, extra_args=args)
    try:
        (worker,) = [p.name for p in stack.processes if p.name.startswith("both-")]
        assert len(peer_ranks(stack, worker)) == 1
        work = workload(hf_tokenizer(str(folder)))
        check_against_hf(folder, work, run_concurrently(stack.spec.gateway_address, work))
        (pool,) = wait_until_idle(stack).pools
        assert pool.preemptions > 0 and pool.prompt_tokens_computed > 0
        if preemption == "swap":
            assert pool.swap_outs > 0 and pool.num_free_swap_blocks == pool.num_swap_blocks
        log = stack.log_tail(stack.process(worker), lines=400)
        assert '"rank": 1' in log and "rank_ready" in log
    finally:
        stack.stop()


def test_a_killed_rank_fails_its_worker_and_requests_finish_on_the_other(tiny_llama_dir, tmp_path):
    args = {"both": TP2, "scheduler": ["--max-num-batched-tokens", "32"]}
    stack = start_stack(
        tiny_llama_dir, tmp_path / "run", prefill=0, decode=0, both=2, extra_args=args
    )
    try:
        tokenizer = hf_tokenizer(str(tiny_llama_dir))
        reference = {p: hf_greedy(tiny_llama_dir, tokenizer.encode(p), 48) for p in SAMPLE_PROMPTS}
        streams = [
            BackgroundStream(stack.spec.gateway_address, greedy_request(p, 48), 120)
            for p in SAMPLE_PROMPTS
        ]
        for stream in streams:
            stream.wait_tokens(2)
        victim = next(p.name for p in stack.processes if p.name.startswith("both-"))
        (rank1,) = peer_ranks(stack, victim)
        rank1.send_signal(signal.SIGKILL)
        assert stack.wait_exit(victim) is not None  # rank 0 stops the whole worker
        for prompt, stream in zip(SAMPLE_PROMPTS, streams, strict=True):
            stream.result()
            assert stream.code == grpc.StatusCode.OK, (stream.code, stream.details)
            assert stream.token_ids == reference[prompt], prompt
        assert "rank_exited" in stack.log_tail(stack.process(victim), lines=200)
        wait_until_idle(stack, skip=(victim,))
    finally:
        stack.stop()
