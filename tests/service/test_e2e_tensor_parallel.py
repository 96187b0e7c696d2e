"""Tensor-parallel workers through the real services, checked against HF `generate`: a
both-role worker of 2 ranks (gloo, one process per rank, started by the worker itself), and
disaggregated stacks whose prefill and decode workers have different tensor-parallel sizes
(2 -> 1, 1 -> 2, 2 -> 2: each decode rank copies exactly its KV heads from the prefill
ranks' shared pools), on GQA models with 2 and with 8 KV heads, under concurrency, chunked
prefill and preemption by recompute and by swap; the pools end leak-free. A rank killed
mid-stream takes its whole worker down and the requests finish exactly on the other."""

from __future__ import annotations

import signal

import grpc
import psutil
import pytest

from common.pb.tandem.internal.v1 import types_pb2
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


def tp_flags(size: int) -> list[str]:
    return ["--tensor-parallel-size", str(size)] if size > 1 else []


@pytest.mark.parametrize(
    ("model", "prefill_tp", "decode_tp", "preemption"),
    [
        ("tiny_llama_dir", 0, 2, "recompute"),
        ("tiny_llama_dir", 2, 1, "recompute"),
        ("eight_kv_heads_dir", 1, 2, "swap"),
        ("eight_kv_heads_dir", 2, 2, "swap"),
    ],
    ids=["both-tp2-2kv", "tp2-to-tp1-2kv", "tp1-to-tp2-8kv-swap", "tp2-to-tp2-8kv-swap"],
)
def test_tensor_parallel_layouts_are_hf_exact_with_chunking_and_preemption(
    model, prefill_tp, decode_tp, preemption, request, tmp_path
):
    """prefill_tp 0: one both-role worker of decode_tp ranks (no KV transfer)."""
    folder = request.getfixturevalue(model)
    scheduler = [*SMALL_POOLS["scheduler"], "--preemption-mode", preemption]
    if prefill_tp == 0:
        shape = dict(prefill=0, decode=0, both=1)
        args = {"both": [*SMALL_POOLS["decode"], *tp_flags(decode_tp)], "scheduler": scheduler}
    else:
        shape = dict(prefill=1, decode=1)
        args = {
            "prefill": [*SMALL_POOLS["prefill"], *tp_flags(prefill_tp)],
            "decode": [*SMALL_POOLS["decode"], *tp_flags(decode_tp)],
            "scheduler": scheduler,
        }
    stack = start_stack(folder, tmp_path / "run", extra_args=args, **shape)
    try:
        workers = {p.name.split("-")[0]: p.name for p in stack.processes if "-" in p.name}
        for role, size in (("prefill", prefill_tp), ("decode", decode_tp), ("both", decode_tp)):
            if role in workers:
                assert len(peer_ranks(stack, workers[role])) == size - 1, role
        work = workload(hf_tokenizer(str(folder)))
        check_against_hf(folder, work, run_concurrently(stack.spec.gateway_address, work))
        pools = wait_until_idle(stack).pools
        (decoding,) = [p for p in pools if p.role != types_pb2.WORKER_ROLE_PREFILL]
        assert decoding.preemptions > 0
        if preemption == "swap":
            assert decoding.swap_outs > 0
            assert decoding.num_free_swap_blocks == decoding.num_swap_blocks
        if prefill_tp:
            assert decoding.kv_transfers > 0
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
