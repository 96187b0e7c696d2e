"""Settings that must agree between the scheduler and its workers, checked when they meet:
the worker sends its side as DescribeWorker metadata, the scheduler refuses to start (one
clear line) when they disagree."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from common.config import KV_TRANSFER_TIMEOUT_METADATA, PROFILE_NUM_TOKENS_METADATA
from common.lifecycle import StartupError
from common.parallel_plan import Layout
from services.scheduler.bootstrap import check_worker_limits, pool_scheduler
from services.scheduler.config import SchedulerConfig
from services.scheduler.worker_client import limits_from_metadata
from services.scheduler.worker_types import ModelShape, WorkerInfo, WorkerLimits

SHAPE = ModelShape("m", "llama", 100, 64, (2,), "float32", 2, 2, 8)


def info(role: str = "prefill", limits: WorkerLimits | None = None) -> WorkerInfo:
    return WorkerInfo(f"{role}-1", "127.0.0.1:1", role, SHAPE, 64, 16, 1024, b"ucx", 0, limits)


def config(**settings) -> SchedulerConfig:
    return SchedulerConfig(workers=("127.0.0.1:1",), **settings)


# --- the check ---------------------------------------------------------------------------------


@pytest.mark.parametrize("role", ["prefill", "decode", "both"])
def test_profile_num_tokens_below_the_step_budget_is_refused(role):
    worker = info(role, WorkerLimits(profile_num_tokens=512))
    with pytest.raises(StartupError) as caught:
        check_worker_limits(config(max_num_batched_tokens=2048), worker)
    message = str(caught.value)
    assert "\n" not in message
    assert f"worker {role}-1" in message
    assert "profile_num_tokens=512" in message
    assert "max_num_batched_tokens=2048" in message
    assert "--profile-num-tokens 2048" in message


@pytest.mark.parametrize("tokens", [2048, 4096])
def test_profile_num_tokens_at_or_above_the_step_budget_is_accepted(tokens):
    worker = info("both", WorkerLimits(profile_num_tokens=tokens))
    check_worker_limits(config(max_num_batched_tokens=2048), worker)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_worker_kv_timeout_longer_than_the_schedulers_is_refused(role):
    worker = info(role, WorkerLimits(kv_transfer_timeout_s=30.0))
    with pytest.raises(StartupError) as caught:
        check_worker_limits(config(kv_transfer_timeout_s=10.0), worker)
    message = str(caught.value)
    assert "\n" not in message
    assert "kv_transfer_timeout_s=30" in message
    assert "scheduler's kv_transfer_timeout_s=10" in message
    assert "--kv-transfer-timeout-s 10 or less" in message


@pytest.mark.parametrize("worker_timeout", [10.0, 60.0])
def test_worker_kv_timeout_at_most_the_schedulers_is_accepted(worker_timeout):
    worker = info("decode", WorkerLimits(kv_transfer_timeout_s=worker_timeout))
    check_worker_limits(config(kv_transfer_timeout_s=60.0), worker)


def test_both_workers_transfer_no_kv_so_their_timeout_is_not_checked():
    worker = info("both", WorkerLimits(kv_transfer_timeout_s=600.0))
    check_worker_limits(config(kv_transfer_timeout_s=10.0), worker)


def test_a_worker_that_sends_no_limits_is_accepted_unchecked():
    check_worker_limits(config(max_num_batched_tokens=1 << 20, kv_transfer_timeout_s=0.1), info())
    # A CPU worker sends its KV timeout only: nothing profiled, nothing to compare.
    cpu = info("prefill", WorkerLimits(kv_transfer_timeout_s=1.0))
    check_worker_limits(config(max_num_batched_tokens=1 << 20), cpu)


def test_the_pool_scheduler_of_a_worker_checks_it_too():
    """`pool_scheduler` builds the pool of every worker, at connect and when one rejoins."""
    worker = info("prefill", WorkerLimits(profile_num_tokens=16))
    with pytest.raises(StartupError, match="profile_num_tokens=16"):
        pool_scheduler(config(max_num_batched_tokens=64), worker)
    assert pool_scheduler(config(max_num_batched_tokens=16), worker).max_num_batched_tokens == 16


# --- the metadata ------------------------------------------------------------------------------


def test_limits_are_read_from_the_metadata():
    metadata = [
        ("content-type", "application/grpc"),
        (PROFILE_NUM_TOKENS_METADATA, "4096"),
        (KV_TRANSFER_TIMEOUT_METADATA, "7.5"),
    ]
    assert limits_from_metadata(metadata) == WorkerLimits(4096, 7.5)
    assert limits_from_metadata([(KV_TRANSFER_TIMEOUT_METADATA, "60.0")]) == WorkerLimits(
        None, 60.0
    )
    assert limits_from_metadata([("content-type", "application/grpc")]) is None
    assert limits_from_metadata(None) is None


class RecordingContext:
    def __init__(self) -> None:
        self.initial_metadata = None

    async def send_initial_metadata(self, metadata) -> None:
        self.initial_metadata = tuple(metadata)


def fake_worker(device: str) -> SimpleNamespace:
    from services.worker.config import WorkerConfig

    model_config = SimpleNamespace(
        name="m",
        architecture="llama",
        vocab_size=100,
        eos_token_ids=(2,),
        num_hidden_layers=2,
        num_key_value_heads=2,
        head_dim=8,
        rope_type="default",
    )
    cache = SimpleNamespace(dtype=torch.float32, num_blocks=64, block_size=16, block_bytes=1024)
    return SimpleNamespace(
        worker_id="w",
        role="decode",
        config=WorkerConfig(model="m", profile_num_tokens=4096, kv_transfer_timeout_s=7.5),
        model_config=model_config,
        max_model_len=64,
        kv_cache=cache,
        kv_groups=SimpleNamespace(windows=(None,)),
        swap_cache=None,
        offload_cache=None,
        disk_offload=None,
        peer_kv=SimpleNamespace(transport=SimpleNamespace(address=b"ucx")),
        shared_pool=None,
        speculative=None,
        layout=Layout(),
        rank_shared_memory=(),
        rank_ucx_addresses=(),
        lora=None,
        model_block_bytes=1024,
        batch=[],
        device=torch.device(device),
    )


@pytest.mark.parametrize(
    "device, expected",
    [("cuda", WorkerLimits(4096, 7.5)), ("cpu", WorkerLimits(None, 7.5))],
)
def test_describe_worker_sends_the_limits_as_initial_metadata(device, expected):
    """Only a CUDA worker profiles activation memory, so only it sends profile_num_tokens."""
    from services.worker.server import WorkerServicer

    servicer, context = WorkerServicer(), RecordingContext()
    servicer.worker = fake_worker(device)
    response = asyncio.run(servicer.DescribeWorker(None, context))
    assert response.worker_id == "w"
    assert limits_from_metadata(context.initial_metadata) == expected


def test_worker_client_reads_the_limits_a_worker_sends():
    """Over real gRPC: WorkerClient.wait_ready returns the limits beside the description."""
    import grpc

    from common.pb.tandem.internal.v1 import worker_pb2_grpc
    from services.scheduler.worker_client import WorkerClient
    from services.worker.server import WorkerServicer

    async def scenario() -> WorkerInfo:
        server = grpc.aio.server()
        servicer = WorkerServicer()
        servicer.worker = fake_worker("cuda")
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = WorkerClient(f"127.0.0.1:{port}")
        try:
            return await client.wait_ready(10)
        finally:
            await client.close()
            await server.stop(0)

    described = asyncio.run(scenario())
    assert (described.worker_id, described.role) == ("w", "decode")
    assert described.limits == WorkerLimits(profile_num_tokens=4096, kv_transfer_timeout_s=7.5)


def test_a_step_written_after_the_stream_ended_is_a_worker_failure():
    """Over real gRPC: a write on a Step stream the worker already ended (it died between
    two steps) raises WorkerUnavailableError, so the scheduler fails the worker and
    restarts its requests, rather than aborting them as an internal error."""
    import grpc

    from common.pb.tandem.internal.v1 import worker_pb2_grpc
    from services.scheduler.step_plan import PoolStepPlan
    from services.scheduler.worker_client import WorkerClient
    from services.scheduler.worker_types import WorkerUnavailableError

    class EndsAtOnce(worker_pb2_grpc.WorkerServiceServicer):
        async def Step(self, request_iterator, context):
            await context.abort(grpc.StatusCode.UNAVAILABLE, "going away")

    async def scenario() -> tuple[str, str]:
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(EndsAtOnce(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = WorkerClient(f"127.0.0.1:{port}")
        try:
            await client.open_step_stream()
            with pytest.raises(WorkerUnavailableError) as read_error:
                await client.receive_step()  # the stream is over
            with pytest.raises(WorkerUnavailableError) as write_error:
                await client.send_step(PoolStepPlan(cancelled_transfer_tags=[1]))
            return str(read_error.value), str(write_error.value)
        finally:
            await client.close()
            await server.stop(0)

    read_error, write_error = asyncio.run(scenario())
    assert "UNAVAILABLE going away" in read_error
    assert "UNAVAILABLE going away" in write_error
