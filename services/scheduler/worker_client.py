"""The scheduler's connection to one worker: describe, the Step stream, KV transfer calls.

Domain plans go in (`PoolStepPlan`), protobuf goes over the wire, and sampled tokens come
back as a dict; nothing else in the scheduler touches worker protobufs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from common.grpc_server import open_channel
from common.healthcheck import channel_health_status
from common.pb.tandem.internal.v1 import types_pb2, worker_pb2, worker_pb2_grpc
from services.scheduler.pool_scheduler import PoolStepPlan
from services.scheduler.request import Logprob, Request

ROLE_FROM_PB = {
    types_pb2.WORKER_ROLE_PREFILL: "prefill",
    types_pb2.WORKER_ROLE_DECODE: "decode",
    types_pb2.WORKER_ROLE_BOTH: "both",
}


class WorkerUnavailableError(RuntimeError):
    """The worker's Step stream or a KV call failed: the worker is gone or broken."""


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    address: str
    role: str
    model: types_pb2.ModelDescription
    num_blocks: int
    block_size: int
    block_bytes: int
    ucx_address: bytes
    num_swap_blocks: int = 0


@dataclass(frozen=True)
class StepResult:
    step_id: int
    sampled: dict[str, int]
    execute_seconds: float
    logprobs: dict[str, Logprob] = field(default_factory=dict)
    # request id -> (first prompt position covered, entries)
    prompt_logprobs: dict[str, tuple[int, list[Logprob]]] = field(default_factory=dict)


def logprob_from_pb(pb: types_pb2.TokenLogprob) -> Logprob:
    return Logprob(pb.token_id, pb.logprob, tuple((t.token_id, t.logprob) for t in pb.top_logprobs))


def _sampling_pb(request: Request) -> types_pb2.SamplingParams:
    s = request.sampling
    message = types_pb2.SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        logit_bias=dict(s.logit_bias),
        min_tokens=s.min_tokens,
        stop_token_ids=sorted(request.stop_token_ids),
    )
    if s.seed is not None:
        message.seed = s.seed
    if s.logprobs is not None:
        message.logprobs = s.logprobs
    if s.prompt_logprobs is not None:
        message.prompt_logprobs = s.prompt_logprobs
    return message


def _copies(pairs: list[tuple[int, int]]) -> list[worker_pb2.BlockCopy]:
    return [worker_pb2.BlockCopy(src=src, dst=dst) for src, dst in pairs]


def plan_to_pb(
    step_id: int, plan: PoolStepPlan, cancelled_transfer_tags: Sequence[int] = ()
) -> worker_pb2.StepRequest:
    message = worker_pb2.StepRequest(
        step_id=step_id,
        cancelled_transfer_tags=cancelled_transfer_tags,
        finished_request_ids=plan.dropped_request_ids,
        swap_out=_copies(plan.swap_out),
        swap_in=_copies(plan.swap_in),
        block_copies=_copies(plan.block_copies),
    )
    for item in plan.scheduled:
        req = item.request
        if item.is_new:
            message.new_requests.append(
                worker_pb2.NewRequest(
                    request_id=req.request_id,
                    token_ids=req.all_token_ids,
                    block_ids=item.new_block_ids,
                    num_computed_tokens=item.num_computed_before,
                    num_scheduled_tokens=item.num_new_tokens,
                    sampling=_sampling_pb(req),
                    num_prompt_tokens=len(req.prompt_token_ids),
                )
            )
        else:
            message.cached_requests.append(
                worker_pb2.CachedRequest(
                    request_id=req.request_id,
                    new_block_ids=[] if item.replaced_table else item.new_block_ids,
                    num_scheduled_tokens=item.num_new_tokens,
                    block_table=item.replaced_table or [],
                )
            )
    return message


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

    async def describe(self, timeout_s: float = 10.0) -> worker_pb2.DescribeWorkerResponse:
        return await self._stub.DescribeWorker(
            worker_pb2.DescribeWorkerRequest(), timeout=timeout_s
        )

    async def wait_ready(self, timeout_s: float) -> WorkerInfo:
        """Poll DescribeWorker until the worker has loaded its model (or time runs out)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                d = await self.describe()
                return WorkerInfo(
                    worker_id=d.worker_id,
                    address=self.address,
                    role=ROLE_FROM_PB[d.role],
                    model=d.model,
                    num_blocks=d.kv_cache.num_blocks,
                    block_size=d.kv_cache.block_size,
                    block_bytes=d.kv_cache.block_bytes,
                    ucx_address=d.ucx_address,
                    num_swap_blocks=d.kv_cache.num_swap_blocks,
                )
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

    @property
    def last_sent_step_id(self) -> int:
        return self._step_id

    async def send_step(
        self, plan: PoolStepPlan, cancelled_transfer_tags: Sequence[int] = ()
    ) -> int:
        """Write a plan on the Step stream without waiting for its result; returns its id."""
        self._step_id += 1
        try:
            await self._step_call.write(plan_to_pb(self._step_id, plan, cancelled_transfer_tags))
        except grpc.aio.AioRpcError as exc:
            raise WorkerUnavailableError(
                f"worker {self.address} step failed: {exc.code().name} {exc.details()}"
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
        return StepResult(
            step_id=response.step_id,
            sampled={t.request_id: t.token_id for t in response.sampled_tokens},
            execute_seconds=response.execute_seconds,
            logprobs={
                t.request_id: logprob_from_pb(t.logprob)
                for t in response.sampled_tokens
                if t.HasField("logprob")
            },
            prompt_logprobs={
                p.request_id: (p.start, [logprob_from_pb(e) for e in p.entries])
                for p in response.prompt_logprobs
            },
        )

    async def send_kv(
        self, tag: int, peer: WorkerInfo, block_ids: list[int], timeout_s: float
    ) -> worker_pb2.SendKvResponse:
        try:
            return await self._stub.SendKv(
                worker_pb2.SendKvRequest(
                    transfer_tag=tag,
                    peer_worker_id=peer.worker_id,
                    peer_ucx_address=peer.ucx_address,
                    block_ids=block_ids,
                ),
                timeout=timeout_s,
            )
        except grpc.aio.AioRpcError as exc:
            raise WorkerUnavailableError(
                f"SendKv on {self.address} failed: {exc.code().name} {exc.details()}"
            ) from exc

    async def receive_kv(
        self, tag: int, block_ids: list[int], timeout_s: float, after_step_id: int
    ) -> worker_pb2.ReceiveKvResponse:
        try:
            return await self._stub.ReceiveKv(
                worker_pb2.ReceiveKvRequest(
                    transfer_tag=tag, block_ids=block_ids, after_step_id=after_step_id
                ),
                timeout=timeout_s,
            )
        except grpc.aio.AioRpcError as exc:
            raise WorkerUnavailableError(
                f"ReceiveKv on {self.address} failed: {exc.code().name} {exc.details()}"
            ) from exc

    async def close(self) -> None:
        self.close_step_stream()
        await self._channel.close()
