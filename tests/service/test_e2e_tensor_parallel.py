"""Tensor- and pipeline-parallel workers through the real services, checked against HF
`generate`: both-role workers of 2 ranks (TP=2, or PP=2: gloo, one process per rank,
started by the worker itself), and disaggregated stacks whose prefill and decode workers
have different layouts (TP 2 -> 1, 1 -> 2, 2 -> 2, PP 2 -> 2, TP 2 -> PP 2: each decode
rank copies exactly its KV heads of its stage's layers from the prefill ranks' shared
pools; and over UCX, TP 2 -> 1, 1 -> 2, TP 2 -> PP 2: every prefill rank sends each decode
rank the heads it holds, rank to rank), on GQA models with 2 and with 8 KV heads, under
concurrency, chunked prefill and preemption by recompute and by swap; the pools end
leak-free. A rank killed mid-stream takes its whole worker down and the requests finish
exactly on the other."""

from __future__ import annotations

import signal

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
    worker = psutil.Process(stack.process(name).pid)
    return [
        p for p in worker.children() if "services.worker.parallel.peer" in " ".join(p.cmdline())
    ]


def layout_flags(layout: str) -> list[str]:
    """ "tp2" / "pp2" / "tp1": the worker flags of that layout."""
    kind, size = layout[:2], int(layout[2:])
    if size == 1:
        return []
    return ["--tensor-parallel-size" if kind == "tp" else "--pipeline-parallel-size", str(size)]


# Workers without shared pools move KV over UCX, every rank its own messages.
UCX = ["--kv-transfer-shared-memory", "false"]


@pytest.mark.parametrize(
    ("model", "prefill", "decode", "preemption", "transport"),
    [
        ("tiny_llama_dir", None, "tp2", "recompute", None),
        ("tiny_llama_dir", "tp2", "tp1", "recompute", "shm"),
        ("eight_kv_heads_dir", "tp1", "tp2", "swap", "shm"),
        ("eight_kv_heads_dir", "tp2", "tp2", "swap", "shm"),
        ("tiny_llama_dir", None, "pp2", "swap", None),
        ("tiny_llama_dir", "pp2", "pp2", "recompute", "shm"),
        ("eight_kv_heads_dir", "tp2", "pp2", "swap", "shm"),
        ("tiny_llama_dir", "tp2", "tp1", "recompute", "ucx"),
        ("eight_kv_heads_dir", "tp1", "tp2", "swap", "ucx"),
        ("eight_kv_heads_dir", "tp2", "pp2", "swap", "ucx"),
    ],
    ids=[
        "both-tp2-2kv", "tp2-to-tp1-2kv", "tp1-to-tp2-8kv-swap", "tp2-to-tp2-8kv-swap",
        "both-pp2-2kv-swap", "pp2-to-pp2-2kv", "tp2-to-pp2-8kv-swap",
        "ucx-tp2-to-tp1-2kv", "ucx-tp1-to-tp2-8kv-swap", "ucx-tp2-to-pp2-8kv-swap",
    ],
)  # fmt: skip
def test_parallel_layouts_are_hf_exact_with_chunking_and_preemption(
    model, prefill, decode, preemption, transport, request, tmp_path
):
    """prefill None: one both-role worker of the decode layout (no KV transfer).
    transport: "shm" (decode ranks copy from the prefill ranks' shared pools) or "ucx"
    (every prefill rank sends each decode rank its KV heads over UCX)."""
    folder = request.getfixturevalue(model)
    scheduler = [*SMALL_POOLS["scheduler"], "--preemption-mode", preemption]
    if prefill is None:
        shape = dict(prefill=0, decode=0, both=1)
        args = {"both": [*SMALL_POOLS["decode"], *layout_flags(decode)], "scheduler": scheduler}
    else:
        shape = dict(prefill=1, decode=1)
        ucx = UCX if transport == "ucx" else []
        args = {
            "prefill": [*SMALL_POOLS["prefill"], *layout_flags(prefill), *ucx],
            "decode": [*SMALL_POOLS["decode"], *layout_flags(decode), *ucx],
            "scheduler": scheduler,
        }
    stack = start_stack(folder, tmp_path / "run", extra_args=args, **shape)
    try:
        workers = {p.name.split("-")[0]: p.name for p in stack.processes if "-" in p.name}
        for role, layout in (("prefill", prefill), ("decode", decode), ("both", decode)):
            if role in workers:
                assert len(peer_ranks(stack, workers[role])) == int(layout[2:]) - 1, role
        work = workload(hf_tokenizer(str(folder)))
        check_against_hf(folder, work, run_concurrently(stack.spec.gateway_address, work))
        pools = wait_until_idle(stack).pools
        (decoding,) = [p for p in pools if p.role != types_pb2.WORKER_ROLE_PREFILL]
        assert decoding.preemptions > 0
        if preemption == "swap":
            assert decoding.swap_outs > 0
            assert decoding.num_free_swap_blocks == decoding.num_swap_blocks
        if prefill is not None:
            assert decoding.kv_transfers > 0
        if transport == "ucx":
            refuse_impossible_layouts(stack, workers)
            assert all(p.num_free_blocks == p.num_blocks for p in wait_until_idle(stack).pools)
    finally:
        stack.stop()


def refuse_impossible_layouts(stack, workers: dict[str, str]) -> None:
    """A peer layout this model cannot have (3 tensor ranks for 4 query heads) is refused
    with INVALID_ARGUMENT naming it, on both sides; the workers serve on."""
    prefill = worker_pb2_grpc.WorkerServiceStub(
        grpc.insecure_channel(stack.process(workers["prefill"]).address)
    )
    decode = worker_pb2_grpc.WorkerServiceStub(
        grpc.insecure_channel(stack.process(workers["decode"]).address)
    )
    calls = [
        lambda: prefill.SendKv(
            worker_pb2.SendKvRequest(
                transfer_tag=1, peer_worker_id="x", peer_ucx_address=b"x", block_ids=[0],
                peer_tensor_parallel_size=3, peer_rank_ucx_addresses=[b"y", b"z"],
            ),
            timeout=10,
        ),
        lambda: decode.ReceiveKv(
            worker_pb2.ReceiveKvRequest(
                transfer_tag=2, block_ids=[0], sender_tensor_parallel_size=3
            ),
            timeout=10,
        ),
    ]  # fmt: skip
    for call, field in zip(calls, ("peer layout", "sender layout"), strict=True):
        with pytest.raises(grpc.RpcError) as refused:
            call()
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in refused.value.details() and "3" in refused.value.details()


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_a_killed_rank_fails_its_worker_and_requests_finish_on_the_other(
    layout, tiny_llama_dir, tmp_path
):
    """pp2: the killed rank is the last stage, the one that samples."""
    args = {"both": layout_flags(layout), "scheduler": ["--max-num-batched-tokens", "32"]}
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
