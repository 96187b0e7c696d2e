"""Tensor- and pipeline-parallel workers through the real services, checked against HF
`generate`: both-role workers of 2 ranks (TP=2 and PP=2 side by side: gloo, one process
per rank, started by the worker itself), and disaggregated stacks whose prefill and
decode workers have different layouts, several in one stack (TP 2 / PP 2 -> TP 1 / PP 2
and TP 1 / TP 2 -> TP 2 / PP 2: each decode rank copies exactly its KV heads of its
stage's layers from the prefill ranks' shared pools; over UCX, TP 1 / TP 2 -> TP 1 /
TP 2 / PP 2: every prefill rank sends each decode rank the heads it holds, rank to rank),
on GQA models with 2 and with 8 KV heads, under concurrency, chunked prefill and
preemption by recompute and by swap; every decode worker receives KV; the pools end
leak-free. A rank killed mid-stream takes its whole worker down and the requests finish
exactly on the other."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import grpc
import psutil
import pytest

from common.pb.tandem.internal.v1 import types_pb2, worker_pb2, worker_pb2_grpc
from devtools.checkpoint_builder import build_checkpoint
from tests.hf_reference import hf_greedy, hf_tokenizer
from tests.service.test_e2e import run_concurrently
from tests.service.test_e2e_scheduling import SMALL_POOLS, check_against_hf, workload
from tests.stack_client import (
    SAMPLE_PROMPTS,
    BackgroundStream,
    greedy_request,
    pool_stats,
    start_stack,
    wait_until_idle,
)


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
    """The worker's other ranks still running, as its log names them (a test stack's
    ranks are forked by a fork server: not the worker's children)."""
    started = [
        json.loads(line)
        for line in Path(stack.process(name).log).read_text().splitlines()
        if '"peer_ranks_started"' in line
    ]
    pids = started[-1]["pids"] if started else []  # a one-rank worker starts none
    return [psutil.Process(pid) for pid in pids if psutil.pid_exists(pid)]


def layout_flags(layout: str) -> list[str]:
    """ "tp2" / "pp2" / "tp1": the worker flags of that layout."""
    kind, size = layout[:2], int(layout[2:])
    if size == 1:
        return []
    return ["--tensor-parallel-size" if kind == "tp" else "--pipeline-parallel-size", str(size)]


# Workers without shared pools move KV over UCX, every rank its own messages.
UCX = ["--kv-transfer-shared-memory", "false"]


# Each stack mixes workers of several layouts: requests spread over the prefill workers
# (least queued work) and the decode workers (fewest blocks to move, then most free), so
# one stack moves KV between several layout pairs (every decode worker must receive some).
@pytest.mark.parametrize(
    ("model", "prefill", "decode", "preemption", "transport"),
    [
        ("tiny_llama_dir", (), ("tp2", "pp2"), "swap", None),
        ("tiny_llama_dir", ("tp2", "pp2"), ("tp1", "pp2"), "recompute", "shm"),
        ("eight_kv_heads_dir", ("tp1", "tp2"), ("tp2", "pp2"), "swap", "shm"),
        ("eight_kv_heads_dir", ("tp1", "tp2"), ("tp1", "tp2", "pp2"), "swap", "ucx"),
    ],
    ids=[
        "both-tp2-pp2-2kv-swap",
        "tp2-pp2-to-tp1-pp2-2kv",
        "tp1-tp2-to-tp2-pp2-8kv-swap",
        "ucx-tp1-tp2-to-tp1-tp2-pp2-8kv-swap",
    ],
)  # fmt: skip
def test_parallel_layouts_are_hf_exact_with_chunking_and_preemption(
    model, prefill, decode, preemption, transport, request, tmp_path
):
    """prefill (): both-role workers of the decode layouts (no KV transfer). transport:
    "shm" (decode ranks copy from the prefill ranks' shared pools) or "ucx" (every prefill
    rank sends each decode rank its KV heads over UCX)."""
    folder = request.getfixturevalue(model)
    scheduler = [*SMALL_POOLS["scheduler"], "--preemption-mode", preemption]
    if not prefill:
        shape = dict(prefill=0, decode=0, both=len(decode))
        args = {"both": SMALL_POOLS["decode"], "scheduler": scheduler}
        args |= {f"both.{i}": layout_flags(layout) for i, layout in enumerate(decode)}
    else:
        shape = dict(prefill=len(prefill), decode=len(decode))
        ucx = UCX if transport == "ucx" else []
        args = {
            "prefill": [*SMALL_POOLS["prefill"], *ucx],
            "decode": [*SMALL_POOLS["decode"], *ucx],
            "scheduler": scheduler,
        }
        args |= {f"prefill.{i}": layout_flags(layout) for i, layout in enumerate(prefill)}
        args |= {f"decode.{i}": layout_flags(layout) for i, layout in enumerate(decode)}
    stack = start_stack(folder, tmp_path / "run", extra_args=args, **shape)
    try:
        workers = [p.name for p in stack.processes if "-" in p.name]
        layouts = {"prefill": prefill, "decode": decode, "both": decode}
        for role in ("prefill", "decode", "both"):
            named = [w for w in workers if w.startswith(role + "-")]
            ranks = sorted(len(peer_ranks(stack, w)) + 1 for w in named)
            assert ranks == sorted(int(layout[2:]) for layout in layouts[role][: len(named)])
        work = workload(hf_tokenizer(str(folder)))
        for _ in range(2):  # the second round meets cached prefixes
            # Queued together (`held`): their KV outgrows the decode pools (`workload`).
            results = run_concurrently(stack.spec.gateway_address, work, held=stack)
            check_against_hf(folder, work, results)
            pools = wait_until_idle(stack).pools
        decoding = [p for p in pools if p.role != types_pb2.WORKER_ROLE_PREFILL]
        assert all(p.steps > 0 for p in pools), "placement used every worker"
        assert any(p.preemptions > 0 for p in decoding)
        if preemption == "swap":
            assert any(p.swap_outs > 0 for p in decoding)
            assert all(p.num_free_swap_blocks == p.num_swap_blocks for p in decoding)
        if prefill:
            assert all(p.kv_transfers > 0 for p in decoding), "every decode layout received KV"
        if transport == "ucx":
            refuse_impossible_layouts(stack, workers)
            assert all(p.num_free_blocks == p.num_blocks for p in wait_until_idle(stack).pools)
    finally:
        stack.stop()


def refuse_impossible_layouts(stack, workers: list[str]) -> None:
    """A peer layout this model cannot have (3 tensor ranks for 8 query heads) is refused
    by the sender with INVALID_ARGUMENT naming it; the workers serve on. (The receiving
    side's load fails alone, named: `test_kv_transfer`.)"""
    first = next(w for w in workers if w.startswith("prefill"))
    prefill = worker_pb2_grpc.WorkerServiceStub(grpc.insecure_channel(stack.process(first).address))
    with pytest.raises(grpc.RpcError) as refused:
        prefill.SendKv(
            worker_pb2.SendKvRequest(
                transfer_tag=1, peer_worker_id="x", peer_ucx_address=b"x", block_ids=[0],
                peer_tensor_parallel_size=3, peer_rank_ucx_addresses=[b"y", b"z"],
            ),
            timeout=10,
        )  # fmt: skip
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "peer layout" in refused.value.details() and "3" in refused.value.details()


def kill_a_rank_mid_stream(stack, victim: str, reference: dict) -> None:
    """Streams on every worker; `victim`'s rank 1 is SIGKILLed: rank 0 stops the whole
    worker and every stream still ends with exactly HF's tokens (on the other worker)."""
    streams = [
        BackgroundStream(stack.spec.gateway_address, greedy_request(p, 48), 120)
        for p in SAMPLE_PROMPTS
    ]
    for stream in streams:
        stream.wait_tokens(2)
    (rank1,) = peer_ranks(stack, victim)
    rank1.send_signal(signal.SIGKILL)
    assert stack.wait_exit(victim) is not None  # rank 0 stops the whole worker
    for prompt, stream in zip(SAMPLE_PROMPTS, streams, strict=True):
        stream.result()
        assert stream.code == grpc.StatusCode.OK, (stream.code, stream.details)
        assert stream.token_ids == reference[prompt], prompt
    assert "rank_exited" in stack.log_tail(stack.process(victim), lines=200)


def test_a_killed_rank_fails_its_worker_and_requests_finish_on_the_other(tiny_llama_dir, tmp_path):
    """Two both-role workers, one TP=2 and one PP=2, each losing a rank in turn: first
    the TP worker (restarted after), then the PP worker's last stage, the one that
    samples. One stack serves both layouts' cases (each layout's rank is killed exactly as
    when each had a stack of its own); the restart also shows a 2-rank worker rejoining."""
    args = {
        "both.0": layout_flags("tp2"),
        "both.1": layout_flags("pp2"),
        "scheduler": ["--max-num-batched-tokens", "32"],
    }
    stack = start_stack(
        tiny_llama_dir, tmp_path / "run", prefill=0, decode=0, both=2, extra_args=args
    )
    try:
        tokenizer = hf_tokenizer(str(tiny_llama_dir))
        reference = {p: hf_greedy(tiny_llama_dir, tokenizer.encode(p), 48) for p in SAMPLE_PROMPTS}
        tp_worker, pp_worker = [p.name for p in stack.processes if p.name.startswith("both-")]
        assert [len(peer_ranks(stack, w)) for w in (tp_worker, pp_worker)] == [1, 1]
        kill_a_rank_mid_stream(stack, tp_worker, reference)
        wait_until_idle(stack, skip=(tp_worker,))
        stack.restart(tp_worker)
        deadline = time.monotonic() + 30
        while not all(p.healthy for p in pool_stats(stack).pools):
            assert time.monotonic() < deadline, "the restarted TP worker did not rejoin"
            time.sleep(0.05)
        kill_a_rank_mid_stream(stack, pp_worker, reference)
        wait_until_idle(stack, skip=(pp_worker,))
    finally:
        stack.stop()
