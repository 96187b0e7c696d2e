"""The scheduler's gRPC connection to one worker (a `WorkerConnection`): describe, the
Step stream, KV transfer calls. Conversions live in `step_codec`; domain types in
`worker_types`."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterable

import grpc

from common.config import KV_TRANSFER_TIMEOUT_METADATA, PROFILE_NUM_TOKENS_METADATA
from common.grpc_server import open_channel
from common.healthcheck import channel_health, channel_health_status
from common.pb.tandem.internal.v1 import worker_pb2, worker_pb2_grpc
from common.step_plan_pb import plan_to_pb
from common.step_result import KvLoadDone, StepResult
from common.step_result_pb import result_from_pb
from common.structured_output import Constraint, constraint_to_pb
from common.tracing import outgoing_metadata
from services.scheduler.pool_scheduler import PoolStepPlan
from services.scheduler.step_codec import worker_info_from_pb
from services.scheduler.worker_types import (
    ConstraintRefusedError,
    LoraRefusedError,
    WorkerInfo,
    WorkerLimits,
    WorkerUnavailableError,
)


def limits_from_metadata(metadata: Iterable[tuple[str, str]] | None) -> WorkerLimits | None:
    """The worker settings sent as DescribeWorker's initial metadata; None when it sends
    none (an older worker: the scheduler then checks nothing against it)."""
    values = dict(metadata or ())
    tokens = values.get(PROFILE_NUM_TOKENS_METADATA)
    timeout = values.get(KV_TRANSFER_TIMEOUT_METADATA)
    if tokens is None and timeout is None:
        return None
    return WorkerLimits(
        profile_num_tokens=None if tokens is None else int(tokens),
        kv_transfer_timeout_s=None if timeout is None else float(timeout),
    )


class WorkerClient:
    def __init__(self, address: str, step_timeout_s: float | None = None) -> None:
        self.address = address
        self.step_timeout_s = step_timeout_s
        self._channel = open_channel(address)
        self._stub = worker_pb2_grpc.WorkerServiceStub(self._channel)
        self._step_call = None
        self._step_id = 0

    async def health(self, timeout_s: float) -> str:
        """The worker's grpc.health.v1 status name, or 'UNREACHABLE' (down, hung, or not
        answering within timeout_s)."""
        return await channel_health_status(self._channel, timeout_s)

    async def health_boot(self, timeout_s: float) -> tuple[str, str]:
        """The status, and the worker process's boot id (its health answer's metadata)."""
        return await channel_health(self._channel, timeout_s)

    async def describe(self, timeout_s: float = 10.0) -> worker_pb2.DescribeWorkerResponse:
        response, _ = await self._describe(timeout_s)
        return response

    async def _describe(
        self, timeout_s: float = 10.0
    ) -> tuple[worker_pb2.DescribeWorkerResponse, WorkerLimits | None]:
        """DescribeWorker's response and the limits sent beside it as metadata."""
        call = self._stub.DescribeWorker(worker_pb2.DescribeWorkerRequest(), timeout=timeout_s)
        response = await call
        return response, limits_from_metadata(await call.initial_metadata())

    async def wait_ready(self, timeout_s: float) -> WorkerInfo:
        """Poll DescribeWorker until the worker has loaded its model (or time runs out)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                response, limits = await self._describe()
                info = worker_info_from_pb(self.address, response)
                return dataclasses.replace(info, limits=limits)
            except grpc.aio.AioRpcError as exc:
                if time.monotonic() > deadline:
                    raise WorkerUnavailableError(
                        f"worker {self.address} not ready after {timeout_s:.0f}s: "
                        f"{exc.code().name} {exc.details()}"
                    ) from exc
                await asyncio.sleep(0.25)

    async def open_step_stream(self) -> None:
        """A new Step stream (the worker forgets every request it held); step ids restart."""
        self.close_step_stream()
        self._step_id = 0
        self._step_call = self._stub.Step()

    def close_step_stream(self) -> None:
        if self._step_call is not None:
            self._step_call.cancel()
            self._step_call = None

    async def send_step(self, plan: PoolStepPlan) -> int:
        """Write a plan on the Step stream without waiting for its result; returns its id."""
        self._step_id += 1
        try:
            await self._step_call.write(plan_to_pb(plan.worker_plan(self._step_id)))
        except grpc.aio.AioRpcError as exc:
            raise WorkerUnavailableError(
                f"worker {self.address} step failed: {exc.code().name} {exc.details()}"
            ) from exc
        except asyncio.InvalidStateError as exc:  # the stream ended before this write
            call = self._step_call
            raise WorkerUnavailableError(
                f"worker {self.address} step failed: {(await call.code()).name} "
                f"{await call.details()}"
            ) from exc
        return self._step_id

    async def receive_step(self) -> StepResult:
        """The result of the oldest step sent and not yet answered."""
        try:
            response = await asyncio.wait_for(self._step_call.read(), self.step_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise WorkerUnavailableError(
                f"worker {self.address} step failed: {exc.code().name} {exc.details()}"
            ) from exc
        except TimeoutError as exc:
            raise WorkerUnavailableError(
                f"worker {self.address} did not answer a step within {self.step_timeout_s}s"
            ) from exc
        if response is grpc.aio.EOF:
            raise WorkerUnavailableError(f"worker {self.address} closed its step stream")
        return result_from_pb(response)

    async def send_kv(
        self, tag: int, peer: WorkerInfo, block_ids: list[int], timeout_s: float
    ) -> KvLoadDone:
        try:
            response = await self._stub.SendKv(
                worker_pb2.SendKvRequest(
                    transfer_tag=tag,
                    peer_worker_id=peer.worker_id,
                    peer_ucx_address=peer.ucx_address,
                    block_ids=block_ids,
                    peer_tensor_parallel_size=peer.tensor_parallel_size,
                    peer_pipeline_parallel_size=peer.pipeline_parallel_size,
                    peer_rank_ucx_addresses=list(peer.rank_ucx_addresses),
                ),
                timeout=timeout_s,
                metadata=outgoing_metadata(),  # the transfer's span, when traced
            )
        except grpc.aio.AioRpcError as exc:
            raise WorkerUnavailableError(
                f"SendKv on {self.address} failed: {exc.code().name} {exc.details()}"
            ) from exc
        return KvLoadDone(tag, num_bytes=response.num_bytes)

    async def add_lora(self, name: str, path: str, timeout_s: float) -> None:
        await self._lora_call(
            self._stub.AddLora, worker_pb2.AddLoraRequest(lora_name=name, lora_path=path), timeout_s
        )

    async def remove_lora(self, name: str, timeout_s: float) -> None:
        await self._lora_call(
            self._stub.RemoveLora, worker_pb2.RemoveLoraRequest(lora_name=name), timeout_s
        )

    async def prepare_structured(self, constraint: Constraint, timeout_s: float) -> None:
        request = worker_pb2.PrepareStructuredOutputRequest()
        constraint_to_pb(constraint, request.structured_output)
        try:
            await self._stub.PrepareStructuredOutput(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ConstraintRefusedError(exc.details() or "") from exc
            raise WorkerUnavailableError(
                f"PrepareStructuredOutput on {self.address} failed: "
                f"{exc.code().name} {exc.details()}"
            ) from exc

    async def _lora_call(self, method, request, timeout_s: float) -> None:
        try:
            await method(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
                raise LoraRefusedError(code.name, exc.details() or "") from exc
            raise WorkerUnavailableError(
                f"{type(request).__name__.removesuffix('Request')} on {self.address} failed: "
                f"{code.name} {exc.details()}"
            ) from exc

    async def close(self) -> None:
        self.close_step_stream()
        await self._channel.close()
